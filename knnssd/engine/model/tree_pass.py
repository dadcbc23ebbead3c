"""Token-tree passes (``tree.py`` holds the trees): one sequence's tree verified in one pass
(``forward_tree``), its accepted path's K/V put where a chain would have them (``settle``), and the same
for trees packed into a pass over several slots (``forward_trees``, ``settle_slots``).

A node's row must equal the row its token gets in a chain (docs/exactness.md): the linears run on all
nodes at once, attention once per leaf's segment over its path's keys, or, on the native step, all
nodes in one call that reads each path's keys through a map (``native.TreeMap``, ``tree_rows``).
"""
from __future__ import annotations

import torch

from knnssd.engine.model import native, tree
from knnssd.engine.model.attention import NATIVE, PREFILL_ROWS, Attention
from knnssd.engine.model.cache import SlotPool
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.forms import Output
from knnssd.engine.model.layers import SpanMask, attn_out, embed, heads, logits, mlp, one_slot, span_masks
from knnssd.engine.model.weights import Stack


@torch.inference_mode()
def forward_tree(dec: Decoder, ids: torch.Tensor, start: int, parents: tuple[int, ...]
                 ) -> tuple[Output, list[tuple[torch.Tensor, torch.Tensor]] | None]:
    """Verify a token tree (``tree.py``): ids (N + 1,) the root at position ``start`` and the drafted
    nodes, each at ``start`` + its depth. Returns the logits of every node and, for ``settle``, each
    layer's K/V of the nodes, (N + 1, KV, D) each, or None where the pass ran as one native call (which
    wrote node j's K/V at place ``start + j``). The linears run on all the nodes; attention runs once
    per leaf's segment, over its path's keys written at the path's positions (what a chain reads)."""
    s, attn, T = dec.stack, dec.attention, ids.shape[0]
    if T > PREFILL_ROWS:
        raise ValueError(f"a tree of {T} nodes is more than a verify pass's {PREFILL_ROWS} rows")
    tree.check(parents)
    depth = tree.depths(parents)
    dec.cache.check(start + max(depth) + 1)
    h = embed(s, ids)
    if _tree_call(dec, s, attn, h, start, parents, depth):
        hidden = s.norm(h)[0]
        return Output(logits(s, hidden), hidden), None
    segs = [(torch.tensor(path, device=ids.device), j0, len(path)) for path, j0 in tree.segments(parents)]
    order = torch.cat([path[j0:] for path, j0, _ in segs]).argsort()  # the segments' rows back in node order
    pos = torch.tensor(depth, device=ids.device) + start
    rope = dec.rope_at(pos, h)
    masks: dict[tuple, tuple[SpanMask, ...]] = {}
    kv = []
    for i, layer in enumerate(s.layers):
        q, k, v = heads(s, layer, layer.qkv(layer.attn_norm(h))[0], rope[layer.rope])
        kv.append((k, v))
        pieces = []
        for path, j0, n in segs:
            kc, vc = dec.cache.write(i, slice(start, start + n), k[path].transpose(0, 1)[None],
                                      v[path].transpose(0, 1)[None])
            key = (layer.window, j0, n)
            if key not in masks:
                at = torch.arange(start + j0, start + n, device=ids.device)
                masks[key] = span_masks(attn, at, dec.spans(start + j0, n - j0, attn), layer.window)
            rows = path[j0:]
            pieces += [attn.attend(q[rows[sp.lo : sp.hi]], kc[:, :, : sp.keys], vc[:, :, : sp.keys], m, s.scale)
                       for sp, m in masks[key]]
        h = h + attn_out(layer, torch.cat(pieces, dim=1)[:, order])
        h = h + mlp(layer, h)
    hidden = s.norm(h)[0]
    return Output(logits(s, hidden), hidden), kv

@torch.inference_mode()
def settle(dec: Decoder, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]] | None, path: tuple[int, ...]) -> None:
    """Write the K/V of a tree's accepted ``path`` (root first; ``forward_tree``'s ``kv``) at positions
    ``start..start + len(path) - 1``, where a chain of those tokens would have put them. ``kv`` None: move
    them there from the places ``start + node`` where the native call wrote them."""
    if kv is None:
        moved = tree.moves(path)
        if moved:
            src = torch.tensor([start + node for node, _ in moved], device=dec.device)
            dst = torch.tensor([start + d for _, d in moved], device=dec.device)
            for c in dec.cache.k + dec.cache.v:
                c.index_copy_(2, dst, c.index_select(2, src))
        return
    at = torch.tensor(path, device=dec.device)
    for i, (k, v) in enumerate(kv):
        dec.cache.write(i, slice(start, start + len(path)), k[at].transpose(0, 1)[None], v[at].transpose(0, 1)[None])


def _tree_call(dec: Decoder, s: Stack, attn: Attention, h: torch.Tensor, start: int, parents: tuple[int, ...],
               depth: list[int]) -> bool:
    """A tree's layers as one native call (``native.TreeMap``), where ``_one_call`` would run a chain's and
    the reservation holds a place per node: node j writes its K/V at place ``start + j`` and reads its
    path's from theirs. h (1, N + 1, E) is updated in place; False where the call does not apply."""
    T = h.shape[1]
    layers = tree_layers(dec, attn)
    if layers is None or start + T > dec.cache.length:
        return False
    pos, where = tree_rows([(T, start)], [parents])
    cos, sin = dec.tables()[s.rope_keys[0]]
    return layers(h[0], one_slot(T), pos, cos, sin, dec.cache.k, dec.cache.v, None, s.scale, tree=where)

def tree_layers(dec: Decoder, attn: Attention | None = None) -> native.Layers | None:
    """The one-call native layers where they verify token trees (their attention reads a key map), else None."""
    s, attn = dec.stack, attn or dec.attention
    if attn.name != NATIVE.name or not s.rope_static:
        return None
    layers = dec.layers_call(s)
    return layers if layers is not None and layers.trees else None


def packs_trees(slot: object, pool: object) -> bool:
    """Whether ``forward_slots`` over slots like ``slot`` and their ``pool`` verifies token trees (``trees``):
    the native layers over a ``SlotPool``."""
    return _pool_tree_layers(slot, pool) is not None


def _pool_tree_layers(slot: object, pool: object) -> native.Layers | None:
    """The native layers that verify token trees in a packed pass over ``pool`` (``packs_trees``), else None."""
    return tree_layers(slot) if isinstance(pool, SlotPool) and isinstance(slot, Decoder) else None


def tree_rows(calls: list[tuple[int, int]], trees: list[tuple[int, ...] | None]
              ) -> tuple[torch.Tensor, native.TreeMap]:
    """The positions and ``native.TreeMap`` of a pass's rows: ``calls[b]`` = (rows, start) of sequence b, whose
    rows are the token tree ``trees[b]`` (its parents) or a chain (None). Row j of a call writes its K/V
    at place start + j; a tree's node sits at start + its depth and reads its path's places; a chain's
    rows map nothing (key start past their positions)."""
    pos, wpos, kstart, paths = [], [], [], []
    for (T, start), parents in zip(calls, trees):
        wpos += range(start, start + T)
        if parents is None:
            pos += range(start, start + T)
            kstart += [start + T] * T
            paths += [[]] * T
        else:
            pos += [start + d for d in tree.depths(parents)]
            kstart += [start] * T
            paths += [[start + j for j in path] for path in tree.paths(parents)]
    width = max(1, *(len(p) for p in paths))
    kmap = torch.tensor([p + [0] * (width - len(p)) for p in paths])
    return torch.tensor(pos), native.TreeMap(torch.tensor(wpos), torch.tensor(kstart), kmap)


def settle_slots(slots: list["Decoder"], starts: list[int], paths: list[tuple[int, ...]], pool: SlotPool) -> None:
    """``Decoder.settle`` for trees a packed pass verified (``forward_slots`` with ``trees``), in one move a
    layer over the ``pool``: each accepted path's K/V from where its nodes were written to its positions."""
    rows, src, dst = [], [], []
    for slot, start, path in zip(slots, starts, paths):
        for node, d in tree.moves(path):
            rows.append(slot.cache.index)
            src.append(start + node)
            dst.append(start + d)
    if rows:
        pool.move(torch.tensor(rows), torch.tensor(src), torch.tensor(dst))


def forward_trees(slots: list[Decoder], calls: list[tuple[torch.Tensor, int]], trees: list[tuple[int, ...] | None],
                   pool: SlotPool | None, h: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    s = slots[0].stack
    layers = _pool_tree_layers(slots[0], pool)
    if layers is None or any(getattr(slot.cache, "pool", None) is not pool for slot in slots):
        raise ValueError("a packed pass verifies token trees only with the native layers over one slot pool")
    for slot, (ids, start), parents in zip(slots, calls, trees):
        if parents is not None:
            tree.check(parents)
        slot.cache.check(start + ids.shape[0])
    pos, where = tree_rows([(ids.shape[0], start) for ids, start in calls], trees)
    index = torch.tensor([slot.cache.index for slot, t in zip(slots, sizes) for _ in range(t)])
    cos, sin = slots[0].tables()[s.rope_keys[0]]
    if not layers(h[0], index, pos, cos, sin, pool.k, pool.v, None, s.scale, tree=where):
        raise ValueError("the native layers did not take this packed pass of token trees")
    return list(logits(s, s.norm(h)[0]).split(sizes))
