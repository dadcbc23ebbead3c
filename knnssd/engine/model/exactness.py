"""Is the verify pass exact? Measured at load, for the loaded model, dtype and device.

Speculative output equals plain decoding exactly when every row of a T-token pass is bitwise
equal to what T one-token steps give (the logits, and the K/V later steps read). Whether it is
depends on the kernels: a GEMM may round one row differently from many, and attention over a
different key length or mask path may too. So the probe measures it:

1. **Linears.** Each projection shape is run on random rows, M = 1..max_t, against M = 1
   calls, and takes the first form that passes: as is, ``weights.RowPadded``, oneDNN-packed, or
   packed and ``RowPadded``.
2. **Attention.** The implementations in ``attention.implementations(max_t)`` are timed (a
   one-token step and a 4-token pass, to the device's end, in turns; with ``packed``, from
   ``build.make_decoder``, also a packed pass of ``BATCH_SLOTS`` sequences, the batched engine's
   step, and the two times are added), then checked cheapest first, each over the whole model:
   for each context length c in ``CONTEXTS``, random tokens, then one-token steps for positions
   c..c+max_t-1 as the reference, then passes of T = 2..max_t tokens at c, each followed by a
   one-token step at c+T (which reads the K/V the pass wrote). Rows must be bitwise equal.
3. The first exact one is kept and the ones after it are not checked. If none
   is exact, the cheapest is kept, ``exact`` is False, and the reason is logged once.

Where the stack runs its layers as one native call (``weights.native_layers``: bf16 on a CPU with the
native linears), the native form is checked first and, if exact, taken without timing the others: only
it runs the one-call path, and it beat the best of them by 1.6x a step and 2.5x a packed pass on a Zen 3
(docs/benchmarks.md), where timing them took most of an 18 s probe.

With a ``record`` file, an exact choice is remembered (``remember``) and the next load takes it
without probing (``Exactness.from_record``). The record's name carries everything the rounding can
depend on besides the weights (``models.LoadedModel.decoder`` names it by model fingerprint, dtype,
device and ``machine_key``: torch build, threads, processor, the kernel settings in the
environment, and the engine's own code), so a recalled choice is one a full probe measured under
the same conditions; change any of them and the probe runs again.

The result (``Exactness``) goes into ``DecodeStats``, the bench report and bank metadata.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from knnssd import locks
from knnssd.engine.model import native_library
from knnssd.engine.model.attention import NATIVE, Attention, implementations
from knnssd.engine.model.cache import SPAN
from knnssd.engine.model.forms import DecoderForm
from knnssd.engine.model.weights import RowPadded, Stack, native_layers
from knnssd.engine.model.timing import median_ms

log = logging.getLogger(__name__)

MAX_T = 12  # longest pass checked: the longest draft (11) plus the bonus position
CONTEXT = 37
# Random token sets the probe checks, one context length each (one set wrongly passed a step that
# a second failed); their passes read key lengths of 64, 64 and 96 (straddling the two: one call per
# length), and 320 (``cache.KVCache.keys``).
CONTEXTS = (CONTEXT, CONTEXT + 23, CONTEXT + 263)
PROBE_POSITIONS = CONTEXTS[-1] + MAX_T  # the cache positions the probe's longest pass reaches
TIMING_ROUNDS = 8  # with 4, a slow spell on the 2-core VM once ranked fp32_pad4 first for bf16 SmolLM2 (11% slower)
# Candidates whose best after PRUNE_AFTER rounds is over PRUNE_MARGIN x the best one's are not timed again:
# a slow spell hits one round, not the best of two, and the slow forms (an SDPA call per key length, padded
# rows) lose by more than that (the probe's `tried`, docs/benchmarks.md), so only near ties need every round.
PRUNE_AFTER = 2
PRUNE_MARGIN = 1.2
TIMING_CONTEXT = 300  # timed at a 320-key length: attention costs grow with the key length
_warned: set[tuple] = set()


@dataclass(frozen=True)
class Exactness:
    exact: bool  # every row of T = 2..max_t passes equals one-token steps, bitwise
    step: str  # the attention implementation in use ("hf": plain HF forwards)
    max_t: int
    dtype: str
    device: str
    linears_adjusted: int = 0  # projections changed to a row-invariant form (packed, RowPadded)
    tried: tuple[tuple[str, str], ...] = ()  # (implementation, what the probe saw)
    note: str = ""  # why not exact, in one line
    from_record: bool = False  # taken from a full probe's record on this machine key, not probed again

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tried"] = dict(self.tried)
        return d

    def describe(self) -> str:
        state = "exact" if self.exact else "NOT exact"
        pad = f", {self.linears_adjusted} linears adjusted" if self.linears_adjusted else ""
        return f"{state} ({self.step} attention{pad}; {self.dtype} on {self.device}, T=1..{self.max_t})"


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a == b).all(-1).sum())


@torch.inference_mode()
def row_check(dec, max_t: int = MAX_T, context: int = CONTEXT, seed: int = 0, stop_early: bool = False
              ) -> tuple[int, int]:
    """(rows bitwise equal to one-token steps, rows compared) for passes of T = 2..max_t tokens
    (``stop_early``: stop at the first pass with a differing row)."""
    vocab = _vocab(dec)
    device = dec.device
    ids = torch.randint(0, vocab, (context + max_t,), generator=torch.Generator().manual_seed(seed)).to(device)
    x = ids[context:]
    dec.reserve(context + max_t)
    dec.forward(ids[:context], 0)
    ref = torch.cat([dec.forward(x[i : i + 1], context + i).logits for i in range(max_t)])
    equal = total = 0
    for t in range(2, max_t + 1):
        equal += _rows_equal(dec.forward(x[:t], context).logits, ref[:t])
        total += t
        if t < max_t:  # the next one-token step reads the K/V this pass wrote
            equal += _rows_equal(dec.forward(x[t : t + 1], context + t).logits, ref[t : t + 1])
            total += 1
        if stop_early and equal < total:
            break
    return equal, total


def _probe_rows(dec: DecoderForm, max_t: int, contexts: tuple[int, ...] = CONTEXTS) -> tuple[int, int]:
    """``row_check`` over ``contexts`` (one random token set each: rounding ties are
    data-dependent), stopping at the first set with a differing row."""
    equal = total = 0
    for seed, context in enumerate(contexts):
        e, t = row_check(dec, max_t, context, seed, stop_early=True)
        equal, total = equal + e, total + t
        if e < t:
            break
    return equal, total


# Row counts past 16 that packed passes are checked at (a sample: every count up to 192 rows would
# take seconds of lm_head calls); up to 16, every count is.
SAMPLED_ROWS = (24, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 160, 192)


def row_counts(max_rows: int) -> tuple[int, ...]:
    """The row counts (2..max_rows) a linear is checked at: every one up to 16, a sample above."""
    return tuple(sorted({*range(2, min(max_rows, 16) + 1), *(m for m in SAMPLED_ROWS if m <= max_rows), max_rows}))


def _linear_invariant(lin, counts: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      seeds: tuple[int, ...] = (1,)) -> bool:
    """Rows of calls with ``counts`` rows equal one-row calls, bitwise, on random inputs (one per seed)."""
    top = max(counts, default=1)
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1, top, lin.weight.shape[-1], generator=g).to(dtype=dtype, device=device)
        with torch.inference_mode():
            ref = torch.cat([lin(x[:, i : i + 1]) for i in range(top)], dim=1)
            if not all(torch.equal(lin(x[:, :m]), ref[:, :m]) for m in counts):
                return False
    return True


def _distinct_linears(stack: Stack) -> dict[tuple, object]:
    out: dict[tuple, object] = {}
    for lin in stack.projections():
        out.setdefault((type(lin).__name__, tuple(lin.weight.shape)), lin)
    out[("lm_head",)] = stack.lm_head
    return out


def linears_invariant(stack: Stack, max_rows: int, seeds: tuple[int, ...] = (1, 3)) -> bool:
    """Every projection shape and the lm_head give rows independent of the call's row count, up to
    ``max_rows`` (``row_counts``), on two random inputs: what packing several sequences' rows into one
    call needs (``scheduler.py``)."""
    counts = row_counts(max_rows)
    return all(_linear_invariant(lin, counts, stack.dtype, stack.device, seeds)
               for lin in _distinct_linears(stack).values())


def pad_linears(stack: Stack, max_t: int = MAX_T, max_rows: int | None = None) -> tuple[Stack, int]:
    """Give every projection shape the first row-invariant form of: as is, ``RowPadded``, oneDNN-packed
    (small weights are not packed by default), packed and ``RowPadded``, checked over calls of 2..max_t
    rows (or ``row_counts(max_rows)``, on two inputs). Returns the stack and how many projections
    changed form (a shape with no invariant form stays as is). A form chosen before is undone first."""
    counts = tuple(range(2, max_t + 1)) if max_rows is None else row_counts(max_rows)
    seeds = (1,) if max_rows is None else (1, 3)
    chosen: dict[tuple, object] = {}

    def key(lin) -> tuple:
        return type(lin).__name__, tuple(lin.weight.shape), getattr(lin, "bias", None) is not None

    count = 0

    def forms(lin):
        yield lambda x: x
        yield RowPadded
        if lin.packed(force=True) is not lin:
            yield lambda x: x.packed(force=True)
            yield lambda x: RowPadded(x.packed(force=True))

    def wrap(lin):
        nonlocal count
        lin = lin.inner if isinstance(lin, RowPadded) else lin
        k = key(lin)
        if k not in chosen:
            chosen[k] = next((f for f in forms(lin)
                              if _linear_invariant(f(lin), counts, stack.dtype, stack.device, seeds)), None)
        form = chosen[k]
        if form is None:
            return lin
        out = form(lin)
        count += out is not lin
        return out

    return stack.map_linears(wrap), count


RECALLED = "exact (a full probe's choice on this machine key: not probed again)"


# Candidates are ranked by one sequence's step and a batch's together: two forms that decode one
# sequence at the same speed can differ several-fold in a batch's packed passes (docs/benchmarks.md).
# The batch's sequences sit at different key lengths, as a real batch's do: SDPA forms make one call
# per length, and the native form one call per layer whatever the lengths.
BATCH_SLOTS = 8


def choose(dec, max_t: int = MAX_T, candidates: tuple[Attention, ...] | None = None, record: Path | None = None,
           packed=None) -> "Exactness":
    """Probe ``dec`` (a ``decoder.Decoder``), set its exact step (the module docstring's order), and return
    what was measured; or take the choice ``record`` holds (``remember`` writes it), without probing.
    ``packed``: ``packed.forward_slots``, to time the candidates' packed passes."""
    candidates = candidates or implementations(max_t, dec.stack.device)
    dtype, device = _dtype_name(dec.stack.dtype), str(dec.stack.device)
    stack, adjusted = pad_linears(dec.stack, max_t)
    dec.use_stack(stack)
    remembered = _recall(record, candidates, max_t)
    if remembered is not None:
        dec.set_attention(remembered)
        result = Exactness(True, remembered.name, max_t, dtype, device, adjusted, ((remembered.name, RECALLED),),
                           from_record=True)
        _report(result)
        return result
    if NATIVE in candidates and native_layers(dec.stack) is not None:  # the one-call path: no rival (docstring)
        dec.set_attention(NATIVE)
        equal, total = _probe_rows(dec, max_t)
        if equal == total:
            result = Exactness(True, NATIVE.name, max_t, dtype, device, adjusted,
                               ((NATIVE.name, "exact, its layers in one native call: the others not timed"),))
            _report(result)
            return result
    steps = _step_runs(dec, candidates, max_t)
    batches = _packed_runs(dec, candidates, max_t, packed) if packed is not None else [None] * len(candidates)
    times = _best_of_rounds([(s, b) if b is not None else (s,) for s, b in zip(steps, batches)], dec.device)
    del steps, batches  # their caches: one per candidate, and a batch's slots each
    step, batch_ms = [t[0] for t in times], [t[1] if len(t) > 1 else 0.0 for t in times]
    timed = sorted(zip(step, batch_ms, candidates), key=lambda x: x[0] + x[1])
    tried, chosen = [], None
    for ms, b_ms, impl in timed:  # cheapest first; stop at the first exact one
        pk = f" + {b_ms:.2f} ms packed x{BATCH_SLOTS}" if packed is not None else ""
        if chosen is not None and chosen[2]:
            tried.append((impl.name, f"not checked, {ms:.2f} ms{pk}"))
            continue
        dec.set_attention(impl)
        equal, total = _probe_rows(dec, max_t)
        exact = equal == total
        tried.append((impl.name, f"{'exact' if exact else f'{equal}/{total} rows equal'}, {ms:.2f} ms{pk}"))
        if chosen is None or exact:
            chosen = (ms, impl, exact)
    _, impl, exact = chosen
    dec.set_attention(impl)
    note = "" if exact else (
        "no attention implementation gives rows bitwise equal to one-token steps here ("
        + "; ".join(f"{n}: {r}" for n, r in tried) + "), so speculative output may differ from plain decoding "
        "where two tokens nearly tie" + ("; use --dtype float32 for exact output" if dtype != "float32" else "")
    )
    result = Exactness(exact, impl.name, max_t, dtype, device, adjusted, tuple(tried), note)
    _report(result)
    return result


# Environment variables that choose or tune kernels (oneDNN's ISA, MKL's code path, OpenMP, ATen's
# CPU dispatch, cuBLAS workspaces and TF32).
KERNEL_ENV = ("DNNL_", "ONEDNN_", "MKL_", "OMP_", "KMP_", "ATEN_", "CUBLAS_", "NVIDIA_TF32", "TORCH_BLAS")
# Of those, the ones that only say how idle threads wait (spin or sleep): they change no result, and a server
# is often run with them set, which would otherwise probe again as if on another machine.
WAIT_ENV = frozenset({"OMP_WAIT_POLICY", "KMP_BLOCKTIME"})
# The engine code a forward pass runs (which kernels, on what shapes) and the probe itself.
FORWARD_CODE = tuple(Path(__file__).parent / f for f in (
    "attention.py", "cache.py", "decoder.py", "layers.py", "packed.py", "tree_pass.py", "hf_decoder.py", "build.py",
    "skip.py", "weights.py", "quantized.py", "exactness.py", "native.py", "native.c"))


def machine_key(device: torch.device) -> str:
    """What the kernels' rounding may depend on besides the model: torch build, threads, the
    processor (CPU model and flags, or the GPU's name), kernel settings in the environment, whether
    the native kernels are built (on the CPU), and the engine code of the forward pass (which
    kernels it calls, and how: ``FORWARD_CODE``)."""
    if device.type == "cuda":
        chip = torch.cuda.get_device_name(device)
    else:
        chip = platform.machine() + native_library.processor()
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(KERNEL_ENV) and k not in WAIT_ENV)
    h = hashlib.sha256(f"{torch.__version__}|{torch.get_num_threads()}|{chip}|{env}|"
                       f"{torch.get_float32_matmul_precision()}|{torch.backends.mkldnn.is_available()}|"
                       f"{device.type == 'cpu' and native_library.available()}|{source_digest(FORWARD_CODE)}".encode())
    return h.hexdigest()[:12]


def source_digest(files: Iterable[Path]) -> str:
    """The sha256 of these files' bytes, in order: the code a measurement or search ran, for the records
    and caches that keep what it found (``machine_key``, the batched plan's record, the search cache), or
    a model file's contents (``conversion.convert_gguf``'s key). Read in chunks: a GGUF may not fit in memory
    twice."""
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as r:
            while chunk := r.read(1 << 23):
                h.update(chunk)
    return h.hexdigest()


def _names(candidates: tuple[Attention, ...], max_t: int) -> list[str]:
    return [*(c.name for c in candidates), f"max_t={max_t}"]


def read_record(record: Path | None) -> dict:
    """A record's contents; {} where there is none or it cannot be read (it is then measured again)."""
    try:
        d = json.loads(record.read_text()) if record is not None else {}
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def write_record(record: Path, data: dict) -> None:
    """Replace ``record`` with ``data`` at once (a reader never sees half of it); a read-only cache only
    costs the next reader the measurement again."""
    part = None
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=f".{record.name}.", dir=record.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data))
        os.replace(part, record)
    except OSError as e:
        log.info("cannot remember what was measured in %s: %s", record, e)
        if part is not None:
            Path(part).unlink(missing_ok=True)


def update_record(record: Path, change: Callable[[dict], dict]) -> None:
    """Replace ``record`` with ``change`` of what it holds now, read and written under a lock on its folder
    (no lock file is left): two processes that each add an entry keep both, as each read-modify-write
    sees the other's. Where the lock cannot be taken, the change is written without it."""
    with contextlib.ExitStack() as held:
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(locks.locked(record.parent))
        except OSError as e:
            log.info("cannot lock %s: %s", record.parent, e)
        write_record(record, change(read_record(record)))


def _recall(record: Path | None, candidates: tuple[Attention, ...], max_t: int) -> Attention | None:
    d = read_record(record)
    if d.get("candidates") != _names(candidates, max_t):
        return None
    return next((c for c in candidates if c.name == d.get("step")), None)


def remember(record: Path, result: Exactness, candidates: tuple[Attention, ...] | None = None) -> None:
    """Keep an exact, probed choice in ``record`` for the next load (a caller that checks the decoder
    further, as ``build.make_decoder`` does against HF, writes it only once that check has passed)."""
    if not result.exact or result.from_record:
        return
    candidates = candidates or implementations(result.max_t, result.device)
    write_record(record, {"step": result.step, "candidates": _names(candidates, result.max_t)})


def probe_fixed(dec: DecoderForm, step: str, max_t: int = MAX_T) -> "Exactness":
    """Measure a decoder whose step cannot be changed (the HF fallback, the static step)."""
    equal, total = _probe_rows(dec, max_t)
    exact = equal == total
    p = dec.stack.embed if dec.stack is not None else next(dec.model.parameters())
    dtype = _dtype_name(p.dtype)
    note = "" if exact else (f"the {step} step gives {equal}/{total} rows bitwise equal to one-token steps, so "
                             "speculative output may differ from plain decoding where two tokens nearly tie")
    result = Exactness(exact, step, max_t, dtype, str(p.device), 0, ((step, f"{equal}/{total} rows equal"),), note)
    _report(result)
    return result


def _report(result: Exactness) -> None:
    if result.exact:
        log.info("verify pass %s", result.describe())
        return
    key = (result.step, result.dtype, result.device)
    if key not in _warned:  # once per process and setting
        _warned.add(key)
        log.warning("verify pass is not exact: %s", result.note)


# Timed: plain decoding's one-token step and a typical verify pass. A max_t pass is not: its ~3x longer,
# noisier time hid the one-token step's differences (fp32 once chose 12 padded rows for every step).
TIMED_PASSES = (1, 4)


def _step_runs(dec, candidates: tuple[Attention, ...], max_t: int) -> list[Callable[[], object]]:
    """For each candidate, a run of a one-token step and a 4-token pass."""
    device = dec.device
    ids = torch.zeros(max_t, dtype=torch.long, device=device)
    sizes = [t for t in TIMED_PASSES if t <= max_t]
    runs = []
    for impl in candidates:
        d = dec.slot()  # same weights, its own cache
        d.set_attention(impl)
        d.reserve(TIMING_CONTEXT + max_t)
        runs.append(lambda d=d: [d.forward(ids[:t], TIMING_CONTEXT, last=t == 1) for t in sizes])
    return runs


def _packed_runs(dec, candidates: tuple[Attention, ...], max_t: int, packed) -> list[Callable[[], object]]:
    """For each candidate, a run of a packed pass of ``BATCH_SLOTS`` sequences, one row each: attention
    batched over a ``SlotPool`` where it has a batched form, per sequence otherwise. The sequences sit one
    ``SPAN`` apart, at ``BATCH_SLOTS`` key lengths from ``TIMING_CONTEXT`` on, as the sequences of a batch
    of mixed prompts do (a form that makes one call per key length pays for each)."""
    ids = torch.zeros(1, dtype=torch.long, device=dec.device)
    calls = [(ids, TIMING_CONTEXT + SPAN * b) for b in range(BATCH_SLOTS)]
    runs = []
    for impl in candidates:
        d = dec.slot()
        d.set_attention(impl)
        slots, pool = d.pooled_slots(BATCH_SLOTS) if impl.poolable else (
            [d.slot() for _ in range(BATCH_SLOTS)], None)
        for s, (_, start) in zip(slots, calls):
            s.reserve(start + max_t)
        runs.append(lambda slots=slots, pool=pool: packed(slots, calls, pool))
    return runs


def _best_of_rounds(runs: list[tuple[Callable[[], object], ...]], device: torch.device) -> list[tuple[float, ...]]:
    """Each candidate's best milliseconds of each of its runs, over ``TIMING_ROUNDS`` rounds that take the
    candidates in turn (so a slow spell on a shared machine hits them all, not the one that happened to
    run then). After ``PRUNE_AFTER`` rounds, a candidate whose best total is over ``PRUNE_MARGIN`` x the
    best candidate's keeps its times so far and is not timed again: it ranks after every candidate still
    timed (their totals can only fall)."""
    for parts in runs:
        for run in parts:
            run()  # warm up
    best = [[float("inf")] * len(parts) for parts in runs]
    timed = list(range(len(runs)))
    for r in range(TIMING_ROUNDS):
        for i in timed:
            for j, run in enumerate(runs[i]):
                best[i][j] = min(best[i][j], median_ms(run, device, repeats=1, warmup=0))
        if r + 1 == PRUNE_AFTER:
            least = min(sum(best[i]) for i in timed)
            timed = [i for i in timed if sum(best[i]) <= PRUNE_MARGIN * least]
    return [tuple(b) for b in best]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _vocab(dec: DecoderForm) -> int:
    return dec.stack.embed.shape[0] if dec.stack is not None else dec.model.get_input_embeddings().weight.shape[0]
