"""Several sequences' rows in one full-model pass (``forward_slots``): the linears, norms and MLPs run
once over all rows; attention runs per sequence on its slot's cache, or once per key length over the
rows of one ``SlotPool`` (``_PooledAttention``). Where the probe says the linears and the batched
attention are row-invariant (``plan.pooled_exact``), each sequence's logits equal its own pass's."""
from __future__ import annotations

from typing import NamedTuple

import torch

from knnssd.engine.model import tree_pass
from knnssd.engine.model.attention import NATIVE, Attention, PositionMask, allowed
from knnssd.engine.model.cache import SlotPool, Span
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.layers import attn_out, embed, heads, logits, mlp, span_masks
from knnssd.engine.model.weights import Layer


class _SlotCall(NamedTuple):
    """One sequence's part of a packed pass (``forward_slots``): its slot, positions (as a tensor and as the
    slice its cache writes), the key lengths its rows read, rotary tables, attention step, and the masks its
    layers share."""

    slot: Decoder
    pos: torch.Tensor
    at: slice
    spans: tuple[Span, ...]
    rope: dict
    attn: Attention
    masks: dict


@torch.inference_mode()
def forward_slots(slots: list[Decoder], calls: list[tuple[torch.Tensor, int]], pool: SlotPool | None = None,
                  trees: list[tuple[int, ...] | None] | None = None) -> list[torch.Tensor]:
    """One full-model pass over several sequences: ``calls[b]`` = (ids (T_b,), start_b) runs on
    ``slots[b]`` (slots of one decoder, ``Decoder.slot``). The projections, norms, MLPs and the lm_head
    run once over all the rows. Attention runs per sequence on its slot's cache, as that slot's own
    ``forward`` would run it; or, with the ``pool`` whose caches the slots hold (``SlotPool``), once per
    key length over the pool's rows (``attention.batch``). Where the linears are row-invariant for the
    packed row count, and the batched attention is invariant to the batch and to the padded query rows
    (``plan.pooled_exact`` checks both), each call's logits (T_b, V) equal its own ``forward``'s,
    bitwise. No skip mask: this is verification. A pool with a packed pass of its own
    (``slots.StaticSlots``) runs the calls itself.

    ``trees[b]``: the parents of a token tree that call b's ids are (``tree.py``), or None for a chain. Only
    the native layers over a ``SlotPool`` take trees (``packs_trees``), each node's row bitwise its
    path's chain row as in ``tree_pass.forward_tree``; ``settle_slots`` then puts the accepted paths' K/V in
    place."""
    if trees is not None and all(p is None for p in trees):
        trees = None
    if pool is not None and not isinstance(pool, SlotPool) and trees is None:
        return pool.forward_slots(slots, calls)
    s = slots[0].stack
    sizes = [ids.shape[0] for ids, _ in calls]
    h = embed(s, torch.cat([ids for ids, _ in calls]))
    if trees is not None:
        return tree_pass.forward_trees(slots, calls, trees, pool, h, sizes)
    per_call: list[_SlotCall] = []
    for slot, (ids, start) in zip(slots, calls):
        if slot.stack is not s:
            raise ValueError("forward_slots runs slots of one decoder (the same weights)")
        slot.cache.check(start + ids.shape[0])
        pos = torch.arange(start, start + ids.shape[0], device=ids.device)
        attn = slot.attention_for(ids.shape[0])
        per_call.append(_SlotCall(slot, pos, slice(start, start + ids.shape[0]), slot.spans(start, ids.shape[0], attn),
                                  slot.rope_at(pos, h), attn, {}))
    packed = _PooledAttention(per_call, pool) if pool is not None else None
    if packed is not None and packed.attn.name == NATIVE.name:  # every row alone, as in its own pass
        layers = slots[0].layers_call(s)
        if layers is not None:
            cos, sin = slots[0].tables()[s.rope_keys[0]]
            if layers(h[0], packed.slots, packed.pos, cos, sin, pool.k, pool.v, None, s.scale):
                return list(logits(s, s.norm(h)[0]).split(sizes))
    for i, layer in enumerate(s.layers):
        qkv = layer.qkv(layer.attn_norm(h))[0]
        if packed is not None:
            attended = packed(layer, i, qkv)
        else:
            parts = []
            for c, rows in zip(per_call, qkv.split(sizes)):
                if layer.window not in c.masks:
                    c.masks[layer.window] = span_masks(c.attn, c.pos, c.spans, layer.window)
                parts.append(c.slot.attend(layer, i, rows, c.at, c.rope[layer.rope], c.attn, c.masks[layer.window]))
            attended = torch.cat(parts, dim=1)
        h = h + attn_out(layer, attended)
        h = h + mlp(layer, h)
    return list(logits(s, s.norm(h)[0]).split(sizes))


class _PooledAttention:
    """Attention of a packed pass over slots of one ``SlotPool``: the K/V of all rows written in one
    call, then one batched attention call per key length, over the spans of rows that read it (a
    sequence whose rows straddle two key lengths takes part in two calls), each span's queries padded
    to that call's R rows (at its first position, as ``attention.padded`` pads). A call reads the pool
    rows lo..hi that hold its slots (a slice: no copy) when they are mostly its own, and a copy of just
    its slots' rows otherwise (``GATHER_ABOVE``); rows in a slice that belong to no slot of the call
    read key 0 and are dropped."""

    GATHER_ABOVE = 1.5  # slice rows per member slot above which a call copies its members' rows instead

    def __init__(self, per_call: list["_SlotCall"], pool: SlotPool):
        slot0, attn = per_call[0].slot, per_call[0].attn
        if not attn.poolable or any(
                c.attn is not attn or getattr(c.slot.cache, "pool", None) is not pool for c in per_call):
            raise ValueError("pooled attention needs slots of one pool running a step with a batched form")
        self.pool, self.attn, self.stack = pool, attn, slot0.stack
        device = per_call[0].pos.device
        index = [c.slot.cache.index for c in per_call]
        sizes = [c.pos.shape[0] for c in per_call]
        self.slots = torch.tensor([b for b, t in zip(index, sizes) for _ in range(t)], device=device)
        self.pos = torch.cat([c.pos for c in per_call])
        self.rope = {key: tuple(torch.cat([c.rope[key][j] for c in per_call]) for j in (0, 1))
                     for key in per_call[0].rope}
        self.groups = []
        self.rows: dict[int | None, object] = {}  # window -> ``attn.pooled_rows`` (a form whose rows read own keys)
        if attn.pooled is not None:
            return
        starts = [0]
        for t in sizes:
            starts.append(starts[-1] + t)
        by_length: dict[int, list[tuple[int, Span]]] = {}  # key length -> the (call, span) reading it
        for b, c in enumerate(per_call):
            for sp in c.spans:
                by_length.setdefault(sp.keys, []).append((b, sp))
        for length, members in by_length.items():
            members.sort(key=lambda m: index[m[0]])
            lo, hi = index[members[0][0]], index[members[-1][0]]
            if hi - lo + 1 <= self.GATHER_ABOVE * len(members):
                read, local_of = slice(lo, hi + 1), {b: index[b] - lo for b, _ in members}
            else:
                read = torch.tensor([index[b] for b, _ in members], device=device)
                local_of = {b: j for j, (b, _) in enumerate(members)}
            n_read = hi - lo + 1 if isinstance(read, slice) else len(members)
            R = max(attn.rows, *(sp.hi - sp.lo for _, sp in members))
            rows = torch.tensor([starts[b] + r for b, sp in members for r in range(sp.lo, sp.hi)], device=device)
            local = torch.tensor([local_of[b] for b, sp in members for _ in range(sp.lo, sp.hi)], device=device)
            t = torch.tensor([j for _, sp in members for j in range(sp.hi - sp.lo)], device=device)
            qpos = torch.zeros(n_read, R, dtype=torch.long, device=device)  # rows of no member: position 0
            for b, sp in members:
                p = per_call[b].pos[sp.lo : sp.hi]
                qpos[local_of[b]] = torch.cat((p, p[:1].expand(R - p.shape[0])))
            self.groups.append((length, read, R, rows, local, t, qpos, {}))

    def __call__(self, layer: Layer, i: int, qkv: torch.Tensor) -> torch.Tensor:
        s, n = self.stack, qkv.shape[0]
        H, D = s.n_heads, s.head_dim
        q, k, v = heads(s, layer, qkv, self.rope[layer.rope])
        self.pool.write(i, self.slots, self.pos, k, v)
        if self.attn.pooled is not None:  # every row alone: one call over the pool
            if layer.window not in self.rows:
                self.rows[layer.window] = self.attn.pooled_rows(self.slots, self.pos, layer.window)
            return self.attn.pooled(q, self.pool.k[i], self.pool.v[i], self.rows[layer.window], s.scale)[None]
        out = q.new_empty(n, H * D)
        for length, read, R, rows, local, t, qpos, masks in self.groups:
            if layer.window not in masks:
                masks[layer.window] = PositionMask(allowed_batch(qpos, length, layer.window))
            qg = q.new_zeros(qpos.shape[0], R, H, D)
            qg[local, t] = q[rows]
            k, v = self.pool.k[i][:, :, :length], self.pool.v[i][:, :, :length]
            k, v = (k[read], v[read]) if isinstance(read, slice) else (k.index_select(0, read), v.index_select(0, read))
            out[rows] = self.attn.batch(qg, k, v, masks[layer.window], s.scale)[local, t]
        return out[None]


def allowed_batch(qpos: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """(B, 1, R, length) bool: ``attention.allowed`` for each row of query positions qpos (B, R)."""
    return allowed(qpos, length, window)[:, None]
