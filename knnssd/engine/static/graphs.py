"""Static steps run over one ``StaticCache``, replayed from CUDA graphs where the device has them.

A call's rows are copied into the input buffers of their bucket (``step.rows_bucket``) and padded
with scratch rows. With ``compiled``, the step is ``torch.compile``d (``fullgraph=True, dynamic=False``)
before it is captured: inductor fuses the norms, rotary and pointwise ops, which cuts the kernels a
step launches, and so a replay's time on a launch-bound GPU. Each (skip mask, bucket, slot, key bucket)
is captured once, at its first call (the probe's, ``StaticDecoder.warm``'s or a request's), into one
memory pool shared by all of them, and replayed for every later call with the same key, whatever the
request. A capture that fails leaves its key eager, with a log line. Captures are recorded
(``captures``) with their time and the memory they took.

``StaticDecoder`` runs one sequence on it with ``decoder.Decoder``'s interface, so the decoding loop and
the drafters run unchanged. Whether its graphed T-row pass is exact (its rows bitwise equal to T
one-row steps, the property a greedy verify pass needs) depends on the device's kernels: the load-time
probe (``exactness.probe_fixed``) measures it on the graphed step itself.

Terms: n rows of a call, R its bucket, V vocabulary, E hidden size.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import torch

from knnssd.engine.model import exactness
from knnssd.engine.model.cache import CacheFull
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.forms import Output
from knnssd.engine.model.skip import MaskError, SkipMask
from knnssd.engine.model.weights import Stack
from knnssd.engine.static.step import ROW_BUCKETS, StaticCache, keys_bucket, keys_buckets, plain, rows_bucket, step

log = logging.getLogger(__name__)

CAPTURE_ROWS = 64  # larger buckets (prefills) run eagerly: they are few and their launches are amortized
WARMUP = 2  # eager runs on a side stream before a capture, as torch's CUDA-graph notes ask


class Capture(NamedTuple):
    """One captured graph: its key, the seconds the capture took, and the pool memory it added."""

    skip: SkipMask | None
    rows: int
    slot: int | None  # the one sequence's slot the graph reads, or None (rows of any slots)
    keys: int  # the positions its rows attend over
    seconds: float
    bytes: int


class _Graph(NamedTuple):
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # (R, V), overwritten by every replay
    hidden: torch.Tensor  # (R, E)


class StepRunner:
    """``runner(ids, pos, slots, skip, slot, keys)`` -> logits (n, V) and hidden states (n, E) of n rows
    (``step.step``), on CUDA graphs when ``graphs`` and the device is CUDA, else eagerly. They are views
    of buffers that the next call of the same key overwrites. Nothing checks that ``keys`` is above every
    row's position (that would read the device): a row past it would not see its own key."""

    def __init__(self, s: Stack, cache: StaticCache, graphs: bool = True, compiled: bool = False):
        self.stack, self.cache = plain(s), cache
        self.graphs = graphs and s.device.type == "cuda"
        if graphs and not self.graphs:
            log.info("CUDA graphs need a CUDA device; the static step runs eagerly on %s", s.device)
        self.compiled = compiled  # turned off for good by a failed compile: keys compiled before it stay compiled
        self._step = _compiled_step() if compiled else step
        self.compile_s = 0.0  # seconds the first call of each key spent compiling (with its first run)
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[tuple, _Graph | None] = {}  # (skip, R, slot, keys) -> graph; None: eager (failed)
        self._pool = None
        self._compiled_keys: set[tuple] = set()
        self.captures: list[Capture] = []

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, skip: SkipMask | None = None,
                 slot: int | None = None, keys: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, pos, slots: (n,) long on the cache's device; ``slot``: every row's, where they are one sequence's;
        ``keys``: a key bucket (``step.keys_bucket``) above every row's position, default the cache's
        length (``step.step``)."""
        n = ids.shape[0]
        keys = keys or self.cache.length
        R = self._fill(ids, pos, slots)
        if self.graphs and R <= CAPTURE_ROWS:
            key = (skip, R, slot, keys)
            if key not in self._graphs:
                self._graphs[key] = self._capture(skip, R, slot, keys)
            g = self._graphs[key]
            if g is not None:
                g.graph.replay()
                return g.logits[:n], g.hidden[:n]
        logits, hidden = self._eager(skip, R, slot, keys)
        return logits[:n], hidden[:n]

    @torch.inference_mode()
    def chunked(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, skip: SkipMask | None = None,
                slot: int | None = None, keys: int | None = None, last: bool = False, tap: int | None = None
                ) -> tuple[torch.Tensor, ...]:
        """Logits (n, V), or with ``last`` only the last row's (1, V), and hidden states (n, E) of any number of
        rows, run in chunks of the largest captured bucket (``CAPTURE_ROWS``): a sequence's rows in a later
        chunk read the K/V its rows in an earlier one wrote. Copies, not the runner's buffers. With ``tap``
        (a prompt's prefill for its routing vector, full model only) also the residual stream after layer
        ``tap`` (n, E), computed eagerly and uncompiled in the buckets' buffers (the captured step's kernels,
        where it is not compiled): a prefill runs once a request, so it is not captured."""
        if tap is not None:
            if skip is not None:
                raise MaskError("a tapped pass runs the full model")
            if not 0 <= tap < self.stack.n_layers:
                raise ValueError(f"tap {tap} is not a layer of this {self.stack.n_layers}-layer model")
        n, c = ids.shape[0], self.cache
        outs: list[list[torch.Tensor]] = [[], [], []] if tap is not None else [[], []]
        for lo in range(0, n, CAPTURE_ROWS):  # clones: the next call overwrites the runner's buffers
            hi = min(n, lo + CAPTURE_ROWS)
            if tap is None:
                got = self(ids[lo:hi], pos[lo:hi], slots[lo:hi], skip, slot, keys)
            else:
                R = self._fill(ids[lo:hi], pos[lo:hi], slots[lo:hi])
                got = tuple(x[: hi - lo] for x in step(self.stack, c.k, c.v, c.tables, *self._inputs[R], None, slot,
                                                       keys or c.length, tap=tap))
            if not last or hi == n:
                outs[0].append((got[0][-1:] if last else got[0]).clone())
            for out, x in zip(outs[1:], got[1:]):
                out.append(x.clone())
        return tuple(torch.cat(out) if len(out) > 1 else out[0] for out in outs)

    def _fill(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> int:
        """Copy n rows into their bucket's input buffers, padded with scratch rows; returns the bucket R."""
        n = ids.shape[0]
        R = rows_bucket(n)
        bi, bp, bs = self._buffers(R)
        bi[:n].copy_(ids)
        bp[:n].copy_(pos)
        bs[:n].copy_(slots)
        if R > n:  # scratch rows: position 0 of the scratch slot, which no sequence reads
            bi[n:].zero_()
            bp[n:].zero_()
            bs[n:].fill_(self.cache.scratch)
        return R

    def _buffers(self, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if R not in self._inputs:
            z = lambda: torch.zeros(R, dtype=torch.long, device=self.stack.device)  # noqa: E731
            self._inputs[R] = (z(), z(), z())
        return self._inputs[R]

    def _eager(self, skip: SkipMask | None, R: int, slot: int | None, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        if R > CAPTURE_ROWS:  # a long prefill's few calls would not repay compiling their shapes
            return step(self.stack, c.k, c.v, c.tables, *self._inputs[R], skip, slot, keys)
        if self.compiled and (skip, R, slot, keys) not in self._compiled_keys:
            self._compiled_keys.add((skip, R, slot, keys))
            t0 = time.perf_counter()
            try:
                return self._step(self.stack, c.k, c.v, c.tables, *self._inputs[R], skip, slot, keys)
            except Exception as e:  # a compiler that fails here (no C compiler, no Triton) leaves the step eager
                log.warning("compiling the static step failed (%s: %s); it runs uncompiled", type(e).__name__,
                            str(e).splitlines()[0] if str(e) else "")
                self.compiled, self._step = False, step
            finally:
                self.compile_s += time.perf_counter() - t0
        return self._step(self.stack, c.k, c.v, c.tables, *self._inputs[R], skip, slot, keys)

    def _capture(self, skip: SkipMask | None, R: int, slot: int | None, keys: int) -> _Graph | None:
        """The graph of (skip, R, slot, keys), its warm-up and capture run on the inputs in the buffers (they
        write the K/V that the call itself writes); None where capturing fails."""
        kind = "full" if skip is None else f"draft ({skip.n_skipped} sub-layers skipped)"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    self._eager(skip, R, slot, keys)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # torch.cuda.graph empties the allocator's cache as it starts: empty it first, so that what the
            # capture adds is not netted against cached blocks it frees
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits, hidden = self._eager(skip, R, slot, keys)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        except Exception as e:  # any failure leaves this key eager, never silently
            log.warning("capturing the %s step for %d rows failed (%s: %s); it runs eagerly", kind, R,
                        type(e).__name__, e)
            torch.cuda.synchronize()  # an error the capture hid surfaces here, not in the eager step after it
            return None
        grown = torch.cuda.memory_reserved() - before
        self.captures.append(Capture(skip, R, slot, keys, seconds, grown))
        log.info("captured the %s step for %d rows over %d keys in %.2f s (%.1f MiB)", kind, R, keys, seconds,
                 grown / 2**20)
        return _Graph(graph, logits, hidden)


def _compiled_step():
    """``step.step`` under ``torch.compile``: one graph per (skip mask, bucket, slot, keys), so the
    recompile limits are raised to hold every key a runner captures."""
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, max(getattr(dc, name), 256))
    return torch.compile(step, fullgraph=True, dynamic=False)


class StaticSequence:
    """What every sequence on the static step shares (``StaticDecoder``, ``slots.SlotView``): drafting
    with skip masks, and none of the decoder's other forms."""

    can_skip, can_tree, can_batch, runs_ahead = True, False, False, False  # ``forms.DecoderForm``
    stack: Stack

    def int8_stack(self) -> Stack:
        raise MaskError("the static step runs full-precision weights: no int8 drafts")

    def rollback(self, length: int) -> None:
        """Nothing to do: later positions are masked and overwritten."""

    def _own_weights(self, stack: Stack | None, influence: bool) -> None:
        """Refuse what ``Decoder.forward`` offers and the static step does not."""
        if stack is not None and stack is not self.stack or influence:
            raise MaskError("the static step runs the model's own weights and returns no influence outputs")


class StaticDecoder(StaticSequence):
    """One sequence on the static step: ``decoder.Decoder``'s interface for the decoding loop (``loop.py``)
    and the drafters (``forward``, ``reserve``, ``rollback``), over slot 0 of a ``StaticCache`` of ``length``
    positions, on a ``StepRunner``. A skip mask's draft step is a graph of its own; a tapped pass (a prompt's
    prefill for its routing vector) runs eagerly; int8 draft weights and influence outputs are not offered
    (they raise). ``exactness`` is measured on this step (``exactness.probe_fixed``), since its rows are not
    the eager decoder's, at every key bucket.

    Its steps attend over a key bucket (``step.keys_bucket``) chosen at ``reserve``, which the
    decoding loop calls once a request with the prompt's length plus ``max_new_tokens``: every step of a
    request, plain or speculative, reads the same bucket, so a verify pass's rows are compared with one-row
    steps of the same shape. So a request's tokens may depend on its bucket (on the prompt's length plus
    ``max_new_tokens``) where the attention kernel's sums split by key length and two tokens nearly tie."""

    # plain greedy decoding may launch a step before the last one is read (``loop.Run``): safe because
    # ``rollback`` never discards a position, so the step launched past the one read keeps its K/V
    runs_ahead = True

    def __init__(self, dec: Decoder, length: int, graphs: bool = True, compiled: bool = False):
        least = exactness.PROBE_POSITIONS
        if length < least:
            raise ValueError(f"a static decoder needs a cache of at least {least} positions (the exactness probe's), "
                             f"not {length}")
        self.stack, self.attention, self.device, self.n_layers = dec.stack, dec.attention, dec.device, dec.n_layers
        self.cache = StaticCache(dec.stack, slots=1, length=length)
        self.runner = StepRunner(dec.stack, self.cache, graphs, compiled)
        self.length = length
        self._pos = torch.arange(length, device=self.device)
        self._slots = torch.zeros(1, dtype=torch.long, device=self.device)  # every row's slot, expanded to the rows
        self.keys, self._pinned = length, False  # the key bucket steps read; pinned: reserve leaves it
        self.exactness = None
        probes = []
        try:
            for keys in keys_buckets(length):  # each bucket's attention is its own shape: each is probed
                self.keys, self._pinned = keys, True
                probes.append((keys, exactness.probe_fixed(self, self._form())))
        finally:
            self.keys, self._pinned = length, False
        keys, self.exactness = next(((k, p) for k, p in probes if not p.exact), probes[-1])
        if not self.exactness.exact:
            self.exactness = dataclasses.replace(self.exactness, note=f"{self.exactness.note} (key bucket {keys})")
        # a compile that failed during the probe ran it uncompiled: name the form that was measured
        self.exactness = dataclasses.replace(self.exactness, step=self._form())

    def _form(self) -> str:
        return "static" + ("_compiled" if self.runner.compiled else "") + ("_graphed" if self.runner.graphs else "")

    def warm(self, masks: tuple[SkipMask, ...] = ()) -> float:
        """Capture (and compile) the full step at every row bucket up to ``CAPTURE_ROWS``, and the one-row step
        of each of ``masks``, at every key bucket, now rather than at a request's first use of each; returns
        the seconds it took."""
        t0 = time.perf_counter()
        ids = torch.zeros(CAPTURE_ROWS, dtype=torch.long, device=self.device)
        try:
            for keys in keys_buckets(self.length):
                self.keys, self._pinned = keys, True
                for R in ROW_BUCKETS:
                    if R <= CAPTURE_ROWS:
                        self.forward(ids[:R], 0)
                for mask in masks:
                    self.forward(ids[:1], 0, mask=mask)
        finally:  # a failure part-way leaves reserve choosing buckets again
            self.keys, self._pinned = self.length, False
        return time.perf_counter() - t0

    def reserve(self, n: int) -> None:
        """Check that ``n`` positions fit, and read the smallest key bucket that holds them until the next
        ``reserve``."""
        if n > self.length:
            raise CacheFull(f"{n} positions do not fit the static cache's {self.length}")
        if not self._pinned:
            self.keys = keys_bucket(n, self.length)

    def forward(self, ids: torch.Tensor, start: int, mask: SkipMask | None = None, stack: Stack | None = None,
                last: bool = False, tap: int | None = None, influence: bool = False) -> Output:
        self._own_weights(stack, influence)
        T = ids.shape[0]
        if start + T > self.keys:  # past what was reserved: a bigger bucket (a probe's pinned one never is)
            if self._pinned:
                raise CacheFull(f"{start + T} positions do not fit the probed key bucket of {self.keys}")
            self.reserve(start + T)
        return Output(*self.runner.chunked(ids, self._pos[start : start + T], self._slots.expand(T), mask, slot=0,
                                           keys=self.keys, last=last, tap=tap))
