"""Planning a batched run: how many slots (``auto_slots``, ``max_slots``), and what a run of them needs
measured once (``plan``: row-invariance of packed passes, batched attention, prefix reuse, pass costs),
kept in a record per machine key so the slow checks run once."""
from __future__ import annotations

import hashlib
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from knnssd.engine.model import exactness
from knnssd.engine.model.cache import BUCKET, SPAN, KVCache
from knnssd.engine.model.pass_costs import PassCosts, measure_pass_costs, packed_passes
from knnssd.engine.spec.request_params import KV_MEMORY, too_many_slots
from knnssd.engine.batch.prefixes import prefix_exact
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.packed import forward_slots
from knnssd.engine.model.timing import median_ms

log = logging.getLogger(__name__)

DEFAULT_MEMORY = KV_MEMORY  # bytes of KV cache the slots may hold together


def rows_exact(decoder: Decoder, max_rows: int) -> bool:
    """Are the decoder's projections and lm_head row-invariant for packed calls of up to ``max_rows``
    rows (``exactness.linears_invariant``)? Attention runs per sequence, as a sequence's own pass
    runs it, so these are the only calls packing changes. False unless the decoder's own step is exact."""
    ex = decoder.exactness
    return bool(ex is not None and ex.exact and exactness.linears_invariant(decoder.stack, max_rows))


@torch.inference_mode()
def pooled_exact(decoder: Decoder, slots: int) -> bool:
    """Does attention batched over a ``SlotPool`` (``forward_slots(..., pool)``) give every sequence the
    logits its own pass gives (and, through the later passes, the K/V)? Checked on the real model:
    ``slots`` sequences of random tokens at three key lengths placed so that, from 4 slots on, one
    group is read as a copy of its rows and one as a slice (from 8, one with a non-member inside),
    three packed passes (mixed draft lengths up to ``max_t``, one-token steps that read what the
    first wrote, the lengths reversed), each against every slot's own pass on a cache of its own,
    bitwise. False where the step has no
    batched form or is not exact itself."""
    ex = decoder.exactness
    if ex is None or not ex.exact or not decoder.attention.poolable:
        return False
    max_t = ex.max_t
    pooled, pool = decoder.pooled_slots(slots)
    own = [decoder.slot() for _ in range(slots)]
    vocab = decoder.stack.embed.shape[0]
    g = torch.Generator().manual_seed(7)
    starts = []
    for b in range(slots):
        # key lengths by position (``KVCache.keys``): C at both ends (a copied group), else A or B (every
        # third slot): 8 slots read C,B,A,A,B,A,A,C (two copied groups, a slice with a non-member inside);
        # each sequence starts 3 to 5 positions before a key-length boundary, so its passes of 4 rows and
        # more straddle it (a sequence in two calls, one of them shared with the next length's slots)
        extra = 2 if slots > 2 and b in (0, slots - 1) else 1 if b % 3 == 1 else 0
        ids = torch.randint(0, vocab, (SPAN * (1 + extra) - 3 - b % 3,), generator=g).to(decoder.device)
        for s in (pooled[b], own[b]):
            s.reserve(ids.shape[0] + 2 * max_t + 1)
            s.forward(ids, 0)
        starts.append(ids.shape[0])
    mixed = [1 + (b * 5) % max_t for b in range(slots)]
    for rows in (mixed, [1] * slots, mixed[::-1]):
        calls = [(torch.randint(0, vocab, (t,), generator=g).to(decoder.device), s) for t, s in zip(rows, starts)]
        packed = forward_slots(pooled, calls, pool)
        if not all(torch.equal(x, s.forward(ids, start).logits) for x, s, (ids, start) in zip(packed, own, calls)):
            return False
        starts = [s + t for s, t in zip(starts, rows)]
    return True


def slot_bytes(decoder: Decoder, positions: int) -> int:
    """KV-cache bytes of one slot holding ``positions`` (rounded up to the cache's bucket)."""
    s, cache = decoder.stack, decoder.cache
    per = torch.empty((), dtype=cache.dtype).element_size()
    return 2 * s.n_layers * s.n_kv * s.head_dim * cache.bucket(positions) * per


def max_slots(decoder: Decoder, positions: int, memory: int = DEFAULT_MEMORY) -> int:
    """How many slots of ``positions`` fit in ``memory`` bytes of KV cache (at least 1)."""
    return max(1, memory // slot_bytes(decoder, positions))


def check_slots(decoder: Decoder, slots: int, positions: int, name: str) -> None:
    """A batch size asked for (``name``: the option or variable) within the KV-cache budget, in one line
    before any plan or pass: 100,000 slots never finished planning, or ran out of memory."""
    most = max_slots(decoder, positions)
    if slots > most:
        raise too_many_slots(name, slots, most, positions, DEFAULT_MEMORY)


AUTO_SLOTS = (1, 2, 4, 8, 16, 32, 64)
# More slots must raise plain decoding's tokens/s by this much over the slots chosen so far: low enough that
# the measured gain of the next size does not fall short of it from run to run, where the bigger batch
# was faster in every throughput run (the gains that set it: docs/benchmarks.md).
AUTO_GAIN = 1.05
AUTO_ROUNDS = 7  # timed passes of each of the two sizes compared (alternately, each after one untimed)


def auto_slots(decoder: Decoder, positions: int, jobs: int, memory: int = DEFAULT_MEMORY,
               record: Path | None = None) -> int:
    """The batch size ``--batch-size auto`` picks: of the sizes in ``AUTO_SLOTS`` (within the memory
    budget and the number of jobs), in increasing order, each whose plain batched decoding's tokens/s
    (slots / v(slots), one-row passes at 64 positions) is ``AUTO_GAIN`` times the last chosen size's or
    more, the two sizes timed alternately (medians). Every size is measured: one that gains too little
    does not end the search, since a later size may still gain (docs/benchmarks.md).

    ``record``: the plan's record (``plan``). The choice for a limit that allows the same sizes, under the
    same key and code, is taken from it, as the probe takes its timed choice from its own: a server or a
    run of ``generate`` starts without timing the sizes again. Delete the record to time them again."""
    limit = min(max_slots(decoder, positions, memory), max(1, jobs))
    code = _record_code(decoder, _max_t(decoder)) if record is not None else None
    # keyed on the largest size the limit allows: limits of 4 to 7 time the same sizes, 1, 2 and 4
    key = str(max((x for x in AUTO_SLOTS if x <= limit), default=1))
    known = _by(exactness.read_record(record), code, "auto").get(key)
    if isinstance(known, int) and 1 <= known <= limit:
        log.info("batch size auto: %d slots (of at most %d by memory and jobs), taken from %s (delete it to time "
                 "the sizes again)", known, limit, record)
        return known
    best = _auto_slots(decoder, limit)
    if record is not None:
        _keep(record, code, auto={key: best})
    return best


def _auto_slots(decoder: Decoder, limit: int) -> int:
    """``auto_slots``'s measured choice of at most ``limit`` slots."""
    pooled = decoder.attention.poolable
    best, best_pass = 1, None
    for n in (x for x in AUTO_SLOTS if x <= limit):
        (_, run), = packed_passes(decoder, n, (1,), 64, pooled)
        if best_pass is None:
            best, best_pass = n, run
            continue
        ms = {best: [], n: []}
        for _ in range(AUTO_ROUNDS):  # alternately, so both sizes see the same drift of the machine
            for size, f in ((best, best_pass), (n, run)):
                ms[size].append(median_ms(f, decoder.device, repeats=1))
        gain = n / statistics.median(ms[n]) / (best / statistics.median(ms[best]))
        log.debug("batch size auto: %d slots against %d: %.2fx the tokens/s", n, best, gain)
        if gain >= AUTO_GAIN:
            best, best_pass = n, run
    log.info("batch size auto: %d slots (of at most %d by memory and jobs)", best, limit)
    return best


class SlotSource(Protocol):
    """What a batched run takes its sequences' slots from: a decoder form that batches (``forms.DecoderForm``
    with ``can_batch``), or the static slots, which are above this room and hand out their own views."""

    def pooled_slots(self, n: int) -> tuple[list, object]:
        """``n`` slots over one pool of caches, and the pool."""


@dataclass(frozen=True)
class BatchPlan:
    """What a batched run of a decoder needs measured once: its slots, v(R), whether packed passes of
    up to ``slots * max_t`` rows are row-invariant (then outputs are exact), whether attention
    runs batched over the slots (``pooled``: measured exact, ``pooled_exact``) or per sequence, and
    the positions each pooled slot is allocated at the start (``positions``; 0: as jobs reserve them),
    and whether prompts reuse the leading positions of others in the batch (``reuses_prefixes``: measured
    exact, ``prefix_exact``); ``from_record``: ``pooled`` and ``reuses_prefixes`` were taken from a record
    (``plan``); ``decodes_on``: the decoder the plan measured, where it is not the one the run is given
    (``static.slots.plan``)."""

    slots: int
    costs: PassCosts
    exact: bool
    pooled: bool = False
    positions: int = 0
    reuses_prefixes: bool = False
    from_record: bool = False
    # what the run decodes on where not the decoder it is given: the static slots (``static.slots.plan``) whose
    # passes these figures measured
    decodes_on: SlotSource | None = None


# The engine code the checks run besides the forward pass (the record's name, from
# ``models.LoadedModel.batch_record``, carries the forward pass's code through ``exactness.machine_key``).
CHECK_CODE = tuple(Path(__file__).parents[1] / f for f in ("batch/plan.py", "batch/prefixes.py", "spec/loop.py",
                                                             "spec/sequence.py"))


def plan(decoder: Decoder, slots: int, positions: int = 0, memory: int = DEFAULT_MEMORY,
         record: Path | None = None) -> BatchPlan:
    """Measure what a batched run of ``slots`` sequences needs. Where a projection is not row-invariant
    up to ``slots * max_t`` rows, its form is chosen again over that range (``exactness.pad_linears``:
    the decoder's own passes stay exact, as the new forms are invariant over a wider range). Attention
    is batched over the slots where that is measured exact, and runs per sequence otherwise.

    ``positions``: the most a job of the run reserves (prompt + new tokens), when known. The pooled
    slots are then allocated that long at the start, as far as ``memory`` allows, instead of growing
    as longer prompts arrive: a growth copies every slot's cache, and a run of mixed prompts grew
    several times.

    ``record``: a file under the same name as the decoder's probe record (``exactness``: the same
    model, dtype, device and machine key). Where packed passes are row-invariant, what the two slow
    checks found (``pooled_exact``, ``prefix_exact``) is kept there per slot count, with a hash of the
    code they ran, the attention step, ``max_t`` and each linear's form, and the next plan of as many
    slots under the same key takes it instead of measuring again: they were most of a plan's time. So is
    the row count over which the linears' forms, unchanged, were found row-invariant. Where the check
    changed the forms it runs every time (it changes them again), as do the pass costs (timings)."""
    ex = decoder.exactness
    max_t = _max_t(decoder)
    known = exactness.read_record(record)
    before = _record_code(decoder, max_t) if record is not None else None
    rows = slots * max_t
    # the linears' forms as they are were found row-invariant over this many rows under this key: a property of
    # the kernels, so not measured again (a plan that had to change the forms measures them every time)
    rows_from_record = ex is not None and ex.exact and rows in _invariant(known, before)
    exact = True if rows_from_record else _rows(decoder, slots, max_t)
    code = _record_code(decoder, max_t) if record is not None else None  # the forms may have changed
    kept = _by(known, code, "slots").get(str(slots))
    from_record = exact and isinstance(kept, dict)
    entry = None
    if from_record:
        pooled, reuses = kept.get("pooled") is True, kept.get("reuses_prefixes") is True  # a wrong True costs exactness
        log.info("batched checks for %d slots taken from %s", slots, record)
    else:
        pooled = exact and pooled_exact(decoder, slots)
        # rotary tables that depend on the sequence's length (dynamic NTK, longrope) rotate a lender's keys
        reuses = slots > 1 and decoder.stack.rope_static and prefix_exact(decoder, pooled)
        entry = {str(slots): {"pooled": bool(pooled), "reuses_prefixes": bool(reuses)}}
    invariant = [rows] if exact and code == before and not rows_from_record else []
    if record is not None and exact and (entry or invariant):
        _keep(record, code, slots=entry, rows=invariant)
    log.info("batched attention over %d slots: %s", slots, "one call per key length" if pooled else
             "per sequence (no batched form measured exact for this step)")
    log.info("prompts reuse the leading positions of others in the batch: %s", "yes" if reuses else
             "no (not measured exact for this prefill, or rotary tables set by the length)")
    costs = plan_costs(decoder, slots, max_t, pooled)
    fits = memory // (slots * slot_bytes(decoder, BUCKET) // BUCKET) // BUCKET * BUCKET  # positions within memory
    return BatchPlan(slots, costs, exact, pooled, min(KVCache.bucket(positions), fits) if positions else 0, reuses,
                     from_record)


def plan_costs(decoder, slots: int, max_t: int, pooled: bool) -> PassCosts:
    """v(R) of a batched run of ``slots`` sequences (``pass_costs.measure_pass_costs``): packed passes of 1,
    4 and ``max_t`` rows a sequence, and of one sequence alone."""
    costs = measure_pass_costs(decoder, slots, tuple(sorted({1, min(4, max_t), max_t})), repeats=2, pooled=pooled)
    if slots > 1:  # and one sequence alone, as at low load: below ``slots`` rows v would be flat at v(slots)
        costs = costs.joined(measure_pass_costs(decoder, 1, (1, max_t), repeats=2, pooled=pooled))
    return costs


RECORD_CODES = 4  # a plan record keeps the entries of this many codes (forms), the latest: a plan that changes the
# linears' forms writes under the new forms' code, and the next load's ``auto_slots`` reads under the old one's


def _keep(record: Path, code: str, slots: dict | None = None, rows: list[int] = (), auto: dict | None = None) -> None:
    """Add to a plan record's entries under ``code`` (``update_record``): checks by slot count, row counts
    found invariant, ``auto_slots``'s choices by limit."""
    def change(now: dict) -> dict:
        entry = {"slots": {**_by(now, code, "slots"), **(slots or {})}, "rows": sorted({*_invariant(now, code), *rows}),
                 "auto": {**_by(now, code, "auto"), **(auto or {})}}
        others = [(k, v) for k, v in now.items() if k != code and isinstance(v, dict)]
        return {**dict(others[-(RECORD_CODES - 1) :]), code: entry}

    exactness.update_record(record, change)


def _section(known: dict, code: str | None, name: str) -> object:
    """What a plan record holds under ``code`` and ``name`` (None where it has none)."""
    entry = known.get(code) if code is not None else None
    return entry.get(name) if isinstance(entry, dict) else None


def _by(known: dict, code: str | None, name: str) -> dict:
    """A plan record's entries of one kind, written by the same ``code`` (else none): ``slots``, the checks by
    slot count; ``auto``, ``auto_slots``'s choices by the largest size a limit allows."""
    by = _section(known, code, name)
    return by if isinstance(by, dict) else {}


def _invariant(known: dict, code: str | None) -> set[int]:
    """The row counts a plan record's linears were found row-invariant over, written by the same ``code`` (else
    none)."""
    rows = _section(known, code, "rows")
    return {r for r in rows if isinstance(r, int)} if isinstance(rows, list) else set()


def _max_t(decoder: Decoder) -> int:
    """The most rows a sequence's verify pass takes: the probe's, or 12 where the decoder was not probed."""
    return decoder.exactness.max_t if decoder.exactness is not None else 12


def _record_code(decoder: Decoder, max_t: int) -> str:
    """What the plan record's checks depend on besides the machine key: the code they ran (``CHECK_CODE``),
    the attention step (the probe may choose another when measured again), ``max_t``, and a hash of each
    projection's and the head's form (``RowPadded`` over a packed one, ...), in order: a plan may change
    the forms, and the checks' prefills run far more rows than ``rows_exact`` covers."""
    def form(lin) -> str:
        inner = getattr(lin, "inner", None)
        return type(lin).__name__ + (f"({type(inner).__name__})" if inner is not None else "")

    s = decoder.stack
    forms = hashlib.sha256("|".join(form(lin) for lin in (*s.projections(), s.lm_head)).encode()).hexdigest()
    return f"{exactness.source_digest(CHECK_CODE)[:12]}-{decoder.attention.name}-{max_t}-{forms[:12]}"


def _rows(decoder: Decoder, slots: int, max_t: int) -> bool:
    """Are packed passes of ``slots`` sequences row-invariant (``rows_exact``), after changing the linears'
    forms where needed?"""
    ex = decoder.exactness
    exact = rows_exact(decoder, slots * max_t)
    if ex is not None and ex.exact and not exact:
        stack, changed = exactness.pad_linears(decoder.stack, max_t, max_rows=slots * max_t)
        if changed:
            decoder.use_stack(stack)
            exact = rows_exact(decoder, slots * max_t)
    if ex is not None and ex.exact and not exact:
        log.warning("packed passes of %d sequences are not row-invariant here: batched output may differ from "
                    "plain decoding where two tokens nearly tie (use fewer slots, or --dtype %s)", slots,
                    "float32" if decoder.device.type == "cpu" else "bfloat16")  # on an H200, fp32 was not
    return exact
