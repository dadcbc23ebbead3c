"""Static steps run over one ``StaticCache``, replayed from CUDA graphs where the device has them.

A call's rows are copied into the input buffers of their bucket (``static_step.rows_bucket``) and padded
with scratch rows. Each (skip mask, bucket) is captured once, at its first use, into one memory pool
shared by all of them, and replayed for every later call with the same key, whatever the request. A
capture that fails leaves its key eager, with a log line. Captures are recorded (``captures``) with
their time and the memory they took.

Whether a graphed T-row pass is exact (its rows bitwise equal to T one-row steps, the property a
greedy verify pass needs) depends on the device's kernels; ``rows_exact`` measures it, and a caller
verifies on graphs only at the row counts it found exact.

Terms: n rows of a call, R its bucket, V vocabulary.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from knnssd.engine.skip import SkipMask
from knnssd.engine.stack import Stack
from knnssd.engine.static_step import StaticCache, plain, rows_bucket, step

log = logging.getLogger(__name__)

CAPTURE_ROWS = 64  # larger buckets (prefills) run eagerly: they are few and their launches are amortized
WARMUP = 2  # eager runs on a side stream before a capture, as torch's CUDA-graph notes ask


class Capture(NamedTuple):
    """One captured graph: its key, the seconds the capture took, and the pool memory it added."""

    skip: SkipMask | None
    rows: int
    seconds: float
    bytes: int


class _Graph(NamedTuple):
    graph: "torch.cuda.CUDAGraph"
    out: torch.Tensor  # (R, V) logits, overwritten by every replay


class StepRunner:
    """``runner(ids, pos, slots, skip)`` -> logits (n, V) of n rows (``static_step.step``), on CUDA graphs when
    ``graphs`` and the device is CUDA, else eagerly. The logits are a view of a buffer the next call of
    the same key overwrites."""

    def __init__(self, s: Stack, cache: StaticCache, graphs: bool = True):
        self.stack, self.cache = plain(s), cache
        self.graphs = graphs and s.device.type == "cuda"
        if graphs and not self.graphs:
            log.info("CUDA graphs need a CUDA device; the static step runs eagerly on %s", s.device)
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._graphs: dict[tuple[SkipMask | None, int], _Graph | None] = {}  # None: eager (capture failed)
        self._pool = None
        self.captures: list[Capture] = []

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, skip: SkipMask | None = None
                 ) -> torch.Tensor:
        """ids, pos, slots: (n,) long on the cache's device."""
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
        if self.graphs and R <= CAPTURE_ROWS:
            key = (skip, R)
            if key not in self._graphs:
                self._graphs[key] = self._capture(skip, R)
            g = self._graphs[key]
            if g is not None:
                g.graph.replay()
                return g.out[:n]
        return self._eager(skip, R)[:n]

    def _buffers(self, R: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if R not in self._inputs:
            z = lambda: torch.zeros(R, dtype=torch.long, device=self.stack.device)  # noqa: E731
            self._inputs[R] = (z(), z(), z())
        return self._inputs[R]

    def _eager(self, skip: SkipMask | None, R: int) -> torch.Tensor:
        c = self.cache
        return step(self.stack, c.k, c.v, c.tables, *self._inputs[R], skip)

    def _capture(self, skip: SkipMask | None, R: int) -> _Graph | None:
        """The graph of (skip, R), its warm-up and capture run on the inputs in the buffers (they write the K/V
        that the call itself writes); None where capturing fails."""
        kind = "full" if skip is None else f"draft ({skip.n_skipped} sub-layers skipped)"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP):
                    self._eager(skip, R)
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            before = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._eager(skip, R)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
        except Exception as e:  # any failure leaves this key eager, never silently
            log.warning("capturing the %s step for %d rows failed (%s: %s); it runs eagerly", kind, R,
                        type(e).__name__, e)
            return None
        grown = torch.cuda.memory_reserved() - before
        self.captures.append(Capture(skip, R, seconds, grown))
        log.info("captured the %s step for %d rows in %.2f s (%.1f MiB)", kind, R, seconds, grown / 2**20)
        return _Graph(graph, out)


@torch.inference_mode()
def rows_exact(runner: StepRunner, ids: torch.Tensor, slot: int, start: int) -> dict[int, bool]:
    """For T = 2..len(ids): are the rows of one T-row pass over ``ids`` (T,) at positions start.. of ``slot``
    bitwise equal to T one-row steps at the same positions? The slot's positions from ``start`` on are
    overwritten."""
    device = runner.stack.device
    T = ids.shape[0]
    pos = torch.arange(start, start + T, device=device)
    slots = torch.full((T,), slot, dtype=torch.long, device=device)
    single = torch.cat([runner(ids[t : t + 1], pos[t : t + 1], slots[:1]).clone() for t in range(T)])
    out = {}
    for t in range(2, T + 1):
        rows = runner(ids[:t], pos[:t], slots[:t])
        out[t] = bool(torch.equal(rows, single[:t]))
    return out
