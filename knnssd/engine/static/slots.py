"""The batched engine's sequences on the static step: slots of one ``StaticCache``, run by one ``StepRunner``
(CUDA graphs where the device has them), so that a packed pass over every active sequence is one replay
per 64 rows instead of hundreds of kernel launches.

``StaticSlots(decoder, slots, length)`` stands where ``scheduler.decode_batch`` and ``plan`` take a
decoder: ``pooled_slots`` hands out its ``SlotView``s (one sequence each, with the decoder's interface
for the decoding loop and the drafters), and ``forward_slots`` (which ``packed.forward_slots`` calls for
a pool of this kind) packs every call's rows into one runner call. A view's own calls (its prefill, its
draft steps) run on the same runner, with graphs shared by every slot (``slot=None``: each row reads a
copy of its own slot's keys), so a sequence's row is computed by the same kernels alone and packed.
Every step attends over the whole cache (``length`` positions, one key bucket for the run).

``plan`` measures what a batched run on it needs (``plan.BatchPlan``): its probe on one view, and
``packed_exact``, that rows packed with other sequences' equal the same rows alone, bitwise. Prompts do
not share prefixes here (``reuses_prefixes`` is False).

Terms: S slots, L positions a slot holds, V vocabulary, E hidden size.
"""
from __future__ import annotations

import logging

import torch

from knnssd.engine.model import exactness
from knnssd.engine.batch.plan import BatchPlan, plan_costs
from knnssd.engine.model.cache import CacheFull
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.forms import Output
from knnssd.engine.static.graphs import StaticSequence, StepRunner
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.weights import Stack
from knnssd.engine.static.step import ROW_BUCKETS, StaticCache, keys_bucket

log = logging.getLogger(__name__)


class _SlotCache:
    """What the batched engine asks of a view's cache: copying another view's first positions."""

    def __init__(self, cache: StaticCache, index: int):
        self.static, self.index = cache, index

    def copy_from(self, other: "_SlotCache", n: int) -> None:
        for k in self.static.k + self.static.v:
            k[self.index, :, :n] = k[other.index, :, :n]


class SlotView(StaticSequence):
    """Slot ``index`` of a ``StaticSlots``: one sequence, with ``decoder.Decoder``'s interface for the decoding
    loop and the drafters (``forward``, ``reserve``, ``rollback``). A skip mask's draft step is a graph of its
    own; a tapped pass (a prompt's prefill for its routing vector) runs eagerly; int8 drafts and influence
    outputs are not offered (they raise)."""

    def __init__(self, owner: "StaticSlots", index: int):
        self.owner, self.index = owner, index
        self.stack, self.attention, self.device = owner.stack, owner.attention, owner.device
        self.n_layers = owner.n_layers
        self.cache = _SlotCache(owner.cache, index)

    @property
    def exactness(self):
        return self.owner.exactness

    def reserve(self, n: int) -> None:
        self.owner.check(n)

    def forward(self, ids: torch.Tensor, start: int, mask: SkipMask | None = None, stack: Stack | None = None,
                last: bool = False, tap: int | None = None, influence: bool = False) -> Output:
        self._own_weights(stack, influence)
        T = ids.shape[0]
        self.owner.check(start + T)
        pos = self.owner.positions[start : start + T]
        return Output(*self.owner.runner.chunked(ids, pos, self.owner.slot_rows(self.index, T), mask, last=last,
                                                 tap=tap))


class StaticSlots:
    """``slots`` sequences of ``length`` positions on one static cache and runner: the decoder the batched
    engine takes (``pooled_slots``, ``forward_slots``, ``exactness``) over ``decoder``'s weights."""

    def __init__(self, decoder: Decoder, slots: int, length: int, graphs: bool = True):
        least = exactness.PROBE_POSITIONS
        if length < least:
            raise ValueError(f"static slots need at least {least} positions each (the exactness probe's), not {length}")
        self.stack, self.attention, self.device, self.n_layers = (decoder.stack, decoder.attention, decoder.device,
                                                                  decoder.n_layers)
        self.slots, self.length = slots, length
        self.cache = StaticCache(decoder.stack, slots=slots, length=length)
        self.runner = StepRunner(decoder.stack, self.cache, graphs)
        self.positions = torch.arange(length, device=self.device)
        self._ids = torch.arange(slots, device=self.device)
        self.views = [SlotView(self, i) for i in range(slots)]
        self.exactness = None
        self.exactness = exactness.probe_fixed(self.views[0], "static_slots_graphed" if self.runner.graphs
                                               else "static_slots")

    def check(self, n: int) -> None:
        if n > self.length:
            raise CacheFull(f"{n} positions do not fit the static slots' {self.length}")

    def slot_rows(self, index: int, n: int) -> torch.Tensor:
        """(n,) long: slot ``index`` for each of n rows, on the device."""
        return self._ids[index : index + 1].expand(n)

    def pooled_slots(self, n: int) -> tuple[list[SlotView], "StaticSlots"]:
        """The first ``n`` views, and this as their pool (``packed.forward_slots`` runs it)."""
        if n > self.slots:
            raise ValueError(f"{n} slots asked of static slots that hold {self.slots}")
        return self.views[:n], self

    def grow(self, positions: int) -> None:
        """The positions a run's jobs reserve must fit: the cache does not grow."""
        self.check(positions)

    def forward_slots(self, views: list[SlotView], calls: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """One pass over several views' rows (``packed.forward_slots``'s contract): each call's logits (T_b, V)."""
        sizes = [ids.shape[0] for ids, _ in calls]
        for v, (ids, start) in zip(views, calls):
            if v.owner is not self:
                raise ValueError("forward_slots runs views of one StaticSlots")
            self.check(start + ids.shape[0])
        ids = torch.cat([ids for ids, _ in calls])
        pos = torch.cat([self.positions[start : start + ids.shape[0]] for ids, start in calls])
        slots = torch.cat([self.slot_rows(v.index, n) for v, n in zip(views, sizes)])
        return list(self.runner.chunked(ids, pos, slots)[0].split(sizes))

    @torch.inference_mode()
    def packed_exact(self, slots: int) -> bool:
        """Do rows packed with other sequences' equal the same rows run alone, bitwise, logits and the K/V they
        write? ``slots`` sequences of random tokens at different lengths; then passes whose packed row counts
        land in every row bucket up to ``slots * max_t`` (the packed pass's linears run at its bucket, a
        sequence's own call at a smaller one), each pass's calls run alone first and then packed over the
        same positions. False where the probe found the step itself not exact."""
        ex = self.exactness
        if ex is None or not ex.exact:
            return False
        views = self.views[:slots]
        vocab = self.stack.embed.shape[0]
        g = torch.Generator().manual_seed(7)
        totals = [1] + [b + 1 for b in ROW_BUCKETS if b + 1 <= slots * ex.max_t]  # the smallest total of each bucket
        spread = max(1, self.length - 20 - len(totals) * ex.max_t)  # prompts of different lengths that leave room
        starts = []
        for b, v in enumerate(views):
            n = 20 + (9 * b) % spread
            v.forward(torch.randint(0, vocab, (n,), generator=g).to(self.device), 0)
            starts.append(n)
        for total in totals:
            rows = [min(ex.max_t, total // slots + (b < total % slots)) for b in range(slots)]
            members = [b for b in range(slots) if rows[b]]
            calls = [(torch.randint(0, vocab, (rows[b],), generator=g).to(self.device), starts[b]) for b in members]
            alone, kv = [], []
            for b, (ids, start) in zip(members, calls):
                alone.append(views[b].forward(ids, start).logits)
                kv.append(self._kv(b, start, ids.shape[0]))
            packed = self.forward_slots([views[b] for b in members], calls)
            if not all(torch.equal(a, p) for a, p in zip(alone, packed)):
                return False
            if not all(torch.equal(x, self._kv(b, start, ids.shape[0]))
                       for x, b, (ids, start) in zip(kv, members, calls)):
                return False
            for b in members:
                starts[b] += rows[b]
        return True

    def _kv(self, b: int, start: int, n: int) -> torch.Tensor:
        """A copy of slot ``b``'s K and V at positions start..start+n, every layer."""
        return torch.stack([k[b, :, start : start + n] for k in self.cache.k + self.cache.v])


def slots_length(slots: int, positions: int, bucket_of: int | None, kv_bytes: int, memory: int) -> int:
    """The positions each of ``slots`` static slots holds for jobs of at most ``positions`` each: the static
    decoder's key bucket for them (``keys_bucket`` in a cache of ``bucket_of``; None: no static decoder), so a
    job of that bucket runs the attention shape it runs alone, where that many fit ``memory`` bytes of KV at
    ``kv_bytes`` a position (the budget the eager plan checks); else ``positions``. The probe's at least."""
    length = max(positions, exactness.PROBE_POSITIONS)
    if bucket_of is not None and length <= bucket_of:
        bucket = keys_bucket(length, bucket_of)
        if (slots + 1) * bucket * kv_bytes <= memory:
            return bucket
    return length


def plan(static: StaticSlots, slots: int) -> BatchPlan:
    """What a batched run of ``slots`` sequences on ``static`` needs (``plan.plan``'s for the eager
    engine): whether its outputs are exact (its probe, and ``packed_exact``), and v(R) measured on its runner;
    a run given the plan runs on ``static`` (``decodes_on``), whatever decoder it is handed."""
    ex = static.exactness
    exact = static.packed_exact(slots)
    if ex.exact and not exact:
        log.warning("packed static passes of %d sequences are not row-invariant here: batched output may differ "
                    "from plain decoding where two tokens nearly tie", slots)
    return BatchPlan(slots, plan_costs(static, slots, ex.max_t, pooled=True), exact, pooled=True, decodes_on=static)
