"""Static KV cache: one preallocated K and V buffer per layer, read at a key length set by position.

``reserve(n)`` is called once per generation (at the prefill): it fixes the positions the
generation may write, ``length`` (``n`` rounded up to a bucket of ``BUCKET`` positions). Buffers are
allocated zeroed when they are too small and reused otherwise; a ``KVCache`` is never
reallocated mid-generation. A ``SlotPool`` is: another slot's longer reservation regrows (and
copies) every slot's buffers, so callers take the buffers afresh on every call.

The *key length* a query reads is a function of its own position alone: ``keys(p + 1)``, the
positions up to p rounded up to ``SPAN`` (never past ``length``), with a position mask over the
rest. So the row at position p of a verify pass reads exactly the keys a one-token step at p reads,
whatever the rest of the pass, and a speculative run and a plain run of the same request read keys
of the same length; a pass whose rows straddle a ``SPAN`` boundary is split into one attention
call per key length (``spans``). Attention kernels round the P @ V reduction differently for a
different key length, so every row must read the length its one-token step reads; one length for
the whole generation (the reservation) kept that too, but had every query read up to
``max_new_tokens`` masked keys, where this reads fewer than ``SPAN``.

Rolling back is free: attention masks every position past a query's own, and the next call
overwrites it. Drafts write K/V for the layers they run; verification rewrites every layer for
the same positions. Masked slots always hold finite values (zeros, or an earlier call's K/V),
so a zero attention weight times them is an exact zero.

``dtype`` may be wider than the model's (fp32 K/V for a bf16 model): values are stored exactly
and an fp32 attention then reads them without a conversion per call.
"""
from __future__ import annotations

import math
import mmap
import weakref
from typing import NamedTuple

import torch

BUCKET = 64  # reservations are rounded up to this many positions
SPAN = 32  # key lengths are rounded up to this many positions (a divisor of BUCKET: never past a reservation)


LAZY_BYTES = 1 << 20  # CPU buffers from this size up are mapped, not filled (``zeros``)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer. On the CPU, one of ``LAZY_BYTES`` or more is a private anonymous map, whose pages
    the kernel gives only as they are written (a page read first is the shared zero page): a cache
    reserved for thousands of positions then holds memory for the positions written, where
    ``torch.zeros`` wrote, and so made resident, every byte: a server's pool took every slot's positions
    at its first request (docs/benchmarks.md). The map is unmapped with the last tensor that views it."""
    size = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or size < LAZY_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps ``buf`` alive


class Span(NamedTuple):
    """Rows ``lo``..``hi - 1`` of a call, which all read the first ``keys`` positions of the cache."""

    lo: int
    hi: int
    keys: int


class CacheFull(RuntimeError):
    """A call writes past the positions reserved for this generation."""


class KVCache:
    def __init__(self, n_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (n_layers, n_kv, head_dim)
        self.dtype, self.device = dtype, device
        self.capacity = 0  # allocated positions
        self.length = 0  # positions this generation may write (a multiple of BUCKET)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    @staticmethod
    def bucket(n: int) -> int:
        return max(BUCKET, -(-n // BUCKET) * BUCKET)

    def reserve(self, n: int) -> bool:
        """Reserve ``bucket(n)`` positions for this generation; True if buffers were (re)allocated."""
        self.length = self.bucket(n)
        if self.length <= self.capacity:
            return False
        n_layers, n_kv, d = self.shape
        z = lambda: zeros((1, n_kv, self.length, d), self.dtype, self.device)  # noqa: E731
        self.k = [z() for _ in range(n_layers)]
        self.v = [z() for _ in range(n_layers)]
        self.capacity = self.length
        return True

    def keys(self, end: int) -> int:
        """The key length a query at position ``end - 1`` reads: ``end`` rounded up to ``SPAN`` (within the
        reservation for any ``end`` that ``check`` allows)."""
        return -(-end // SPAN) * SPAN

    def spans(self, start: int, rows: int) -> tuple[Span, ...]:
        """The rows of a call at positions start..start+rows-1, grouped by the key length each reads
        (one group, unless the rows straddle a ``SPAN`` boundary)."""
        self.check(start + rows)
        out, lo = [], 0
        while lo < rows:
            keys = self.keys(start + lo + 1)
            hi = min(rows, keys - start)  # the rows at positions below ``keys`` read that many
            out.append(Span(lo, hi, keys))
            lo = hi
        return tuple(out)

    def check(self, end: int) -> None:
        if end > self.length:
            raise CacheFull(f"positions up to {end - 1} do not fit the {self.length} reserved for this generation")

    def write(self, layer: int, at: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (1, KV, T, D) at positions ``at``: a (T,) tensor, or a slice when the caller knows them
        on the host (a plain copy, a third of an indexed one's cost on a CPU). Returns the (1, KV, capacity, D)
        buffers; a query reads their first ``keys(...)`` positions."""
        kc, vc = self.k[layer], self.v[layer]
        if isinstance(at, slice):
            kc[:, :, at] = k
            vc[:, :, at] = v
        else:
            kc.index_copy_(2, at, k.to(self.dtype))
            vc.index_copy_(2, at, v.to(self.dtype))
        return kc, vc

    def copy_from(self, other: "KVCache", n: int) -> None:
        """Take positions 0..n-1 of every layer from another cache."""
        if other is self:
            raise ValueError("a cache cannot copy its own positions")
        self.check(n)
        for dst, src in zip(self.k + self.v, other.k + other.v):
            dst[:, :, :n] = src[:, :, :n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SlotPool:
    """The KV buffers of ``n`` sequences in one tensor per layer, (n, KV, capacity, D). Slot ``i``'s
    cache (``caches()[i]``, a ``PooledCache``) reads and writes row ``i`` of it at its own key length,
    exactly as a ``KVCache`` of its own would; a packed pass over several slots can then run one
    attention call over a slice of rows (no copy). The capacity grows, for every slot at once, when
    a slot reserves more positions than it holds.

    The slots' caches refer to the pool and the pool to them only weakly, so the pool and its
    buffers (gigabytes for 64 slots) are freed, by reference counting, with the last of the caches:
    with a cycle between them, each batched run's pool stayed until Python's cyclic collector ran,
    and runs in one process piled pools up (3.2 GB each for 32 slots of 4,352 positions)."""

    def __init__(self, n: int, n_layers: int, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.n, self.shape, self.dtype, self.device = n, (n_layers, n_kv, head_dim), dtype, device
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._caches: list[weakref.ref[PooledCache]] = []

    def caches(self) -> list["PooledCache"]:
        """Slot i's cache, for i < n: made once per pool (a second call raises)."""
        if self._caches:
            raise RuntimeError("this pool's caches were already made")
        out = [PooledCache(self, i) for i in range(self.n)]
        self._caches = [weakref.ref(c) for c in out]
        return out

    def grow(self, length: int) -> None:
        """Hold at least ``length`` positions per slot: by half as much again at least (few regrowths
        while longer prompts come in), copying what the slots hold."""
        if length <= self.capacity:
            return
        length = max(length, self.capacity + self.capacity // 2 // BUCKET * BUCKET)
        n_layers, n_kv, d = self.shape

        def bigger(old: list[torch.Tensor]) -> list[torch.Tensor]:
            out = []
            for i in range(n_layers):
                t = zeros((self.n, n_kv, length, d), self.dtype, self.device)
                if old:
                    t[:, :, : self.capacity] = old[i]
                out.append(t)
            return out

        self.k, self.v = bigger(self.k), bigger(self.v)
        self.capacity = length
        for c in filter(None, (r() for r in self._caches)):
            c.k = [t[c.index : c.index + 1] for t in self.k]
            c.v = [t[c.index : c.index + 1] for t in self.v]

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In every layer, copy the K/V at slot ``slots[m]``, position ``src[m]`` to position ``dst[m]`` of
        the same slot ((M,) each): every source is read before any place is written."""
        for t in self.k + self.v:
            t[slots, :, dst] = t[slots, :, src]

    def write(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (R, KV, D) of R rows, row r at slot ``slots[r]``, position ``pos[r]``."""
        self.k[layer][slots, :, pos] = k.to(self.dtype)
        self.v[layer][slots, :, pos] = v.to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PooledCache(KVCache):
    """One slot's view of a ``SlotPool``: a ``KVCache`` whose buffers are row ``index`` of the pool's."""

    def __init__(self, pool: SlotPool, index: int):
        super().__init__(*pool.shape, pool.dtype, pool.device)
        self.pool, self.index = pool, index

    def reserve(self, n: int) -> bool:
        """As ``KVCache.reserve``; True when the buffers this slot sees changed (the pool grew)."""
        self.length = self.bucket(n)
        self.pool.grow(self.length)
        changed = self.capacity != self.pool.capacity
        self.capacity = self.pool.capacity
        return changed

    def nbytes(self) -> int:
        return self.pool.nbytes() // self.pool.n
