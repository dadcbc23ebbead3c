"""The decoder: the lean forward pass over ``weights.Stack`` tensors and a KV cache that rolls back exactly,
with or without a ``skip.SkipMask``.

``Decoder`` is the fast path: the lean forward with a static ``cache.KVCache``. ``HFDecoder`` is the
fallback for architectures the lean forward does not know: plain HF forwards over a ``DynamicCache``
that is cropped on rollback; it cannot skip. Both never touch ``model.config``. ``forward_slots`` packs
several sequences' rows into one pass; ``make_decoder`` picks the decoder and probes its exactness.
"""
from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from knnssd.engine.model import native
from knnssd.engine.model import tree
from knnssd.engine.model.attention import NATIVE, PREFILL_ROWS, SDPA, Attention, PositionMask, allowed, prefill_form
from knnssd.engine.model.cache import KVCache, SlotPool, Span
from knnssd.engine.model.forms import Output
from knnssd.engine.model.skip import MaskError, SkipMask
from knnssd.engine.model.weights import Layer, Stack, UnsupportedArchitecture, from_hf, native_layers

log = logging.getLogger(__name__)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on (T, heads, D): x*cos + rotate_half(x)*sin, with rotate_half(x)*sin = roll(x, D/2)*sin_signed.

    cos, sin_signed: (T, 1, d); d < D rotates only the first d dims (partial rotary, Phi3 style).
    One C call on the CPU where ``native`` is built (the same roundings), else four torch ops.
    """
    y = native.rope(x, cos, sin_signed)
    return rotate(x, cos, sin_signed) if y is None else y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``_rope`` in torch ops alone (what a compiled or captured step runs)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + x.roll(d // 2, -1) * sin_signed
    xr = x[..., :d]
    return torch.cat((xr * cos + xr.roll(d // 2, -1) * sin_signed, x[..., d:]), dim=-1)


def _relative(y: torch.Tensor, h: torch.Tensor) -> float:
    """Mean over tokens of ||y|| / ||h|| (float32 norms)."""
    return float((y.float().norm(dim=-1) / h.float().norm(dim=-1).clamp_min(1e-12)).mean())


def _rope_pair(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (1, T, d) cos/sin -> (T, 1, d) cos and sign-folded sin for ``_rope``."""
    half = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[0, :, None], sin_signed[0, :, None]


class Decoder:
    """The lean forward of a ``Stack`` over a static ``KVCache`` (gpt-fast's shape).

    ``forward(ids, start)`` runs tokens ``ids`` (T,) at positions start..start+T-1 (``start``: an
    int, or the positions as a tensor), reading the cache for earlier positions, and returns
    logits for each (or only the last) position. Attention reads, with a position mask, the key
    length each query's position sets (``KVCache.keys``; a call straddling two runs one attention
    call per length), or, for positions given as a tensor (never read on the host), the whole
    reserved length: one shape for the generation. A generation uses one of the two forms
    throughout (the decode loop passes ints). ``stack`` swaps in another set of weights with the
    same shape (e.g. ``weights.int8()`` for drafts). ``attention`` and ``exactness`` are set by
    ``exactness.choose`` at load.
    """

    can_skip, can_tree, can_batch, runs_ahead = True, True, True, False  # ``forms.DecoderForm``

    def __init__(self, stack: Stack, attention: Attention = SDPA):
        self.stack = stack.packed()
        self.exactness = None  # exactness.Exactness once probed
        self._shared: dict[str, Stack] = {}  # the int8 draft weights, shared with this decoder's slots
        self._native: dict[int, tuple[Stack, native.Layers | None]] = {}  # by stack: its one-call layers
        self.set_attention(attention)

    def set_attention(self, attention: Attention) -> None:
        s = self.stack
        self.attention = attention
        dtype = torch.float32 if attention.cache_fp32 else s.dtype
        self.cache = KVCache(s.n_layers, s.n_kv, s.head_dim, dtype, s.device)
        self._tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def use_stack(self, stack: Stack) -> None:
        """Run other weights of the same shapes (e.g. row-invariant forms of the same linears)."""
        self.stack, self._shared, self._native = stack, {}, {}

    @property
    def n_layers(self) -> int:
        return self.stack.n_layers

    @property
    def device(self) -> torch.device:
        return self.stack.device

    def int8_stack(self) -> Stack:
        if "int8" not in self._shared:
            self._shared["int8"] = self.stack.int8()
        return self._shared["int8"]

    def slot(self) -> "Decoder":
        """Another sequence's view of this decoder: the same weights, step and int8 copy, and a KV
        cache of its own, so each of its attention calls is the one a single-sequence run makes."""
        d = copy.copy(self)
        d.set_attention(self.attention)
        return d

    def pooled_slots(self, n: int) -> tuple[list["Decoder"], SlotPool]:
        """``n`` slots whose caches are the rows of one ``SlotPool`` (for ``forward_slots(..., pool)``)."""
        pool = SlotPool(n, self.n_layers, self.stack.n_kv, self.stack.head_dim, self.cache.dtype, self.device)
        out = []
        for cache in pool.caches():
            d = self.slot()
            d.cache, d._tables = cache, {}
            out.append(d)
        return out, pool

    def reserve(self, n: int) -> None:
        """Start a generation of up to n positions (the cache's reservation)."""
        if self.cache.reserve(n):
            self._tables.clear()

    def rollback(self, length: int) -> None:
        """Forget positions >= length (nothing to do: they are masked and get overwritten)."""

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, start: int | torch.Tensor, mask: SkipMask | None = None, stack: Stack | None = None,
        last: bool = False, tap: int | None = None, influence: bool = False,
    ) -> Output:
        """``influence``: also return, per attention (row 0) and MLP (row 1) sub-layer, the size of its update
        relative to the residual stream it adds to, ||y|| / ||h||, averaged over the tokens (0 for a
        sub-layer that adds nothing, e.g. one whose output projection is zero; the search's first masks
        skip the smallest)."""
        s = stack or self.stack
        tapped = None
        T = ids.shape[0]
        attn = self._attention_for(T)
        if isinstance(start, torch.Tensor):
            pos = at = start
            spans = (Span(0, T, self.cache.length),)
        else:
            if start == 0 and T > self.cache.length:  # a fresh sequence nobody reserved for
                self.reserve(T)
            self.cache.check(start + T)
            pos, at = torch.arange(start, start + T, device=ids.device), slice(start, start + T)
            spans = self._spans(start, T, attn)
        h = self._embed(s, ids)
        if tap is None and not influence and isinstance(at, slice) and self._one_call(s, attn, h, pos, mask):
            hidden = s.norm(h)[0]
            return Output(_logits(s, hidden[-1:] if last else hidden), hidden)
        rope = self._rope(pos, h)
        masks: dict[int | None, object] = {}
        skip_a = mask.attn if mask is not None else None
        skip_m = mask.mlp if mask is not None else None
        sizes = torch.zeros(2, len(s.layers)) if influence else None
        for i, layer in enumerate(s.layers):
            if skip_a is None or not skip_a[i]:
                if layer.window not in masks:
                    masks[layer.window] = _span_masks(attn, pos, spans, layer.window)
                y = self._attention(layer, i, h, at, rope[layer.rope], attn, masks[layer.window])
                if sizes is not None:
                    sizes[0, i] = _relative(y, h)
                h = h + y
            if skip_m is None or not skip_m[i]:
                y = _mlp(layer, h)
                if sizes is not None:
                    sizes[1, i] = _relative(y, h)
                h = h + y
            if i == tap:
                tapped = h[0]
        hidden = s.norm(h)[0]
        return Output(_logits(s, hidden[-1:] if last else hidden), hidden, tapped, sizes)

    @torch.inference_mode()
    def forward_tree(self, ids: torch.Tensor, start: int, parents: tuple[int, ...]
                     ) -> tuple[Output, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """Verify a token tree (``tree.py``): ids (N + 1,) the root at position ``start`` and the drafted
        nodes, each at ``start`` + its depth. Returns the logits of every node and, for ``settle``, each
        layer's K/V of the nodes, (N + 1, KV, D) each, or None where the pass ran as one native call (which
        wrote node j's K/V at place ``start + j``). The linears run on all the nodes; attention runs once
        per leaf's segment, over its path's keys written at the path's positions (what a chain reads)."""
        s, attn, T = self.stack, self.attention, ids.shape[0]
        if T > PREFILL_ROWS:
            raise ValueError(f"a tree of {T} nodes is more than a verify pass's {PREFILL_ROWS} rows")
        tree.check(parents)
        depth = tree.depths(parents)
        self.cache.check(start + max(depth) + 1)
        h = self._embed(s, ids)
        if self._tree_call(s, attn, h, start, parents, depth):
            hidden = s.norm(h)[0]
            return Output(_logits(s, hidden), hidden), None
        segs = [(torch.tensor(path, device=ids.device), j0, len(path)) for path, j0 in tree.segments(parents)]
        order = torch.cat([path[j0:] for path, j0, _ in segs]).argsort()  # the segments' rows back in node order
        pos = torch.tensor(depth, device=ids.device) + start
        rope = self._rope(pos, h)
        masks: dict[tuple, tuple[SpanMask, ...]] = {}
        kv = []
        for i, layer in enumerate(s.layers):
            q, k, v = _heads(s, layer, layer.qkv(layer.attn_norm(h))[0], rope[layer.rope])
            kv.append((k, v))
            pieces = []
            for path, j0, n in segs:
                kc, vc = self.cache.write(i, slice(start, start + n), k[path].transpose(0, 1)[None],
                                          v[path].transpose(0, 1)[None])
                key = (layer.window, j0, n)
                if key not in masks:
                    at = torch.arange(start + j0, start + n, device=ids.device)
                    masks[key] = _span_masks(attn, at, self._spans(start + j0, n - j0, attn), layer.window)
                rows = path[j0:]
                pieces += [attn.attend(q[rows[sp.lo : sp.hi]], kc[:, :, : sp.keys], vc[:, :, : sp.keys], m, s.scale)
                           for sp, m in masks[key]]
            h = h + _attn_out(layer, torch.cat(pieces, dim=1)[:, order])
            h = h + _mlp(layer, h)
        hidden = s.norm(h)[0]
        return Output(_logits(s, hidden), hidden), kv

    @torch.inference_mode()
    def settle(self, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]] | None, path: tuple[int, ...]) -> None:
        """Write the K/V of a tree's accepted ``path`` (root first; ``forward_tree``'s ``kv``) at positions
        ``start..start + len(path) - 1``, where a chain of those tokens would have put them. ``kv`` None: move
        them there from the places ``start + node`` where the native call wrote them."""
        if kv is None:
            moved = tree.moves(path)
            if moved:
                src = torch.tensor([start + node for node, _ in moved], device=self.device)
                dst = torch.tensor([start + d for _, d in moved], device=self.device)
                for c in self.cache.k + self.cache.v:
                    c.index_copy_(2, dst, c.index_select(2, src))
            return
        at = torch.tensor(path, device=self.device)
        for i, (k, v) in enumerate(kv):
            self.cache.write(i, slice(start, start + len(path)), k[at].transpose(0, 1)[None], v[at].transpose(0, 1)[None])

    def _layers_call(self, s: Stack) -> native.Layers | None:
        if id(s) not in self._native:
            self._native[id(s)] = (s, native_layers(s))  # the stack kept: its id is not reused while here
        return self._native[id(s)][1]

    def _one_call(self, s: Stack, attn: Attention, h: torch.Tensor, pos: torch.Tensor, mask: SkipMask | None) -> bool:
        """Run the layers of a step or verify pass as one native call (``native.Layers``) where it applies: the
        native attention step, whose rows it computes bit for bit, at positions known on the host. h
        (1, T, E) is updated in place; False where the call does not apply (h untouched)."""
        if attn.name != NATIVE.name or h.shape[1] > PREFILL_ROWS or not s.rope_static:
            return False
        layers = self._layers_call(s)
        if layers is None:
            return False
        cos, sin = self.tables()[s.rope_keys[0]]
        skip = None if mask is None else (mask.attn, mask.mlp)
        return layers(h[0], self._zeros(h.shape[1]), pos, cos, sin, self.cache.k, self.cache.v, skip, s.scale)

    def _tree_call(self, s: Stack, attn: Attention, h: torch.Tensor, start: int, parents: tuple[int, ...],
                   depth: list[int]) -> bool:
        """A tree's layers as one native call (``native.TreeMap``), where ``_one_call`` would run a chain's and
        the reservation holds a place per node: node j writes its K/V at place ``start + j`` and reads its
        path's from theirs. h (1, N + 1, E) is updated in place; False where the call does not apply."""
        T = h.shape[1]
        layers = self._tree_layers(attn)
        if layers is None or start + T > self.cache.length:
            return False
        pos, where = tree_rows([(T, start)], [parents])
        cos, sin = self.tables()[s.rope_keys[0]]
        return layers(h[0], self._zeros(T), pos, cos, sin, self.cache.k, self.cache.v, None, s.scale, tree=where)

    def _tree_layers(self, attn: Attention | None = None) -> native.Layers | None:
        """The one-call native layers where they verify token trees (their attention reads a key map), else None."""
        s, attn = self.stack, attn or self.attention
        if attn.name != NATIVE.name or not s.rope_static:
            return None
        layers = self._layers_call(s)
        return layers if layers is not None and layers.trees else None

    @staticmethod
    @functools.cache
    def _zeros(rows: int) -> torch.Tensor:
        return torch.zeros(rows, dtype=torch.long)

    def _spans(self, start: int, rows: int, attn: Attention) -> tuple[Span, ...]:
        """The key lengths a call's rows read (``KVCache.spans``); a prefill's rows are never compared with
        one-token steps, so a long one reads one length, its last position's, as does a step whose shapes
        follow the positions anyway (``sdpa_dynamic``)."""
        if rows > PREFILL_ROWS or not attn.static or attn.pooled is not None:  # the last: rows read their own keys
            return (Span(0, rows, self.cache.keys(start + rows)),)
        return self.cache.spans(start, rows)

    def _attention_for(self, rows: int) -> Attention:
        """The probed step; for a prefill, ``attention.prefill_form``."""
        if rows > PREFILL_ROWS:
            return prefill_form(self.attention, self.stack.dtype, self.device)
        return self.attention

    @staticmethod
    def _embed(s: Stack, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, s.embed)[None]
        return h * s.embed_scale if s.embed_scale is not None else h

    def _attention(self, layer: Layer, i: int, h: torch.Tensor, at: torch.Tensor | slice, rope, attn: Attention,
                   masks: tuple["SpanMask", ...]) -> torch.Tensor:
        return _attn_out(layer, self._attend(layer, i, layer.qkv(layer.attn_norm(h))[0], at, rope, attn, masks))

    def _attend(self, layer: Layer, i: int, qkv: torch.Tensor, at: torch.Tensor | slice, rope, attn: Attention,
                masks: tuple["SpanMask", ...]) -> torch.Tensor:
        """Attention of one sequence's rows, from their QKV projection (T, (H + 2 KV) D): writes their K/V to
        this decoder's cache at positions ``at`` (``KVCache.write``), then runs one attention call per span
        of rows (``masks``), over the keys it reads, and returns (1, T, H D), before the output projection."""
        q, k, v = _heads(self.stack, layer, qkv, rope)
        kc, vc = self.cache.write(i, at, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        scale = self.stack.scale
        if len(masks) == 1:  # the common case: no slicing of the queries
            (sp, m), = masks
            return attn.attend(q, kc[:, :, : sp.keys], vc[:, :, : sp.keys], m, scale)
        return torch.cat([attn.attend(q[sp.lo : sp.hi], kc[:, :, : sp.keys], vc[:, :, : sp.keys], m, scale)
                          for sp, m in masks], dim=1)

    def _rope(self, pos: torch.Tensor, h: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        s = self.stack
        if not s.rope_static:  # e.g. dynamic NTK / longrope: cos/sin depend on the sequence length
            return {key: _rope_pair(*_rotary(s, h, pos[None], key)) for key in s.rope_keys}
        return {key: (c[pos], si[pos]) for key, (c, si) in self.tables().items()}

    def tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each rotary key's cos and signed sin (capacity, 1, d) by position, over the cache's whole capacity
        (built again when it grows), for a stack whose tables depend on the position alone. A pooled slot's
        are as long as its pool: a slot that reserved before another grew the pool holds a shorter capacity,
        and the native call refuses tables shorter than the buffers it is given."""
        length = getattr(self.cache, "pool", self.cache).capacity
        if not self._tables or next(iter(self._tables.values()))[0].shape[0] < length:
            self._tables = rope_tables(self.stack, length)
        return self._tables


def _rotary(s: Stack, x: torch.Tensor, pos: torch.Tensor, key: str):
    return s.rotary(x, pos) if key == "all" else s.rotary(x, pos, key)


def rope_tables(s: Stack, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each rotary key's cos and signed sin (length, 1, d) for positions 0..length-1 (``_rope``'s operands),
    for a stack whose tables depend on the position alone (``Stack.rope_static``)."""
    pos = torch.arange(length, device=s.device)[None]
    dummy = torch.empty(0, dtype=s.dtype, device=s.device)
    return {key: _rope_pair(*_rotary(s, dummy, pos, key)) for key in s.rope_keys}


class SpanMask(NamedTuple):
    """A span of a call's rows and its mask (``Attention.mask``) over the keys they read."""

    span: Span
    mask: object


def _span_masks(attn: Attention, pos: torch.Tensor, spans: tuple[Span, ...], window: int | None
                ) -> tuple[SpanMask, ...]:
    return tuple(SpanMask(sp, attn.mask(pos[sp.lo : sp.hi], sp.keys, window)) for sp in spans)


def _heads(s: Stack, layer: Layer, qkv: torch.Tensor, rope, rope_fn: Callable = _rope
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (T, H, D), k, v (T, KV, D) of T rows from their QKV projection (T, (H + 2 KV) D): q and k
    normed per head where the layer does, and rotated (by ``rope_fn``)."""
    T, H, KV, D = qkv.shape[0], s.n_heads, s.n_kv, s.head_dim
    qkv = qkv.view(T, H + 2 * KV, D)
    if layer.q_norm is not None:
        qk = torch.cat((layer.q_norm(qkv[:, :H]), layer.k_norm(qkv[:, H : H + KV])), dim=1)
    else:
        qk = qkv[:, : H + KV]
    qk = rope_fn(qk, *rope)  # (T, H+KV, D)
    return qk[:, :H], qk[:, H:], qkv[:, H + KV :]


def _attn_out(layer: Layer, attended: torch.Tensor) -> torch.Tensor:
    """The attention sub-layer's update from its heads' output (1, T, H D): projection, post-norm."""
    o = layer.o(attended)
    return layer.attn_post_norm(o) if layer.attn_post_norm is not None else o


def _mlp(layer: Layer, h: torch.Tensor) -> torch.Tensor:
    gu = layer.gate_up(layer.mlp_norm(h))
    a = native.silu_mul(gu) if layer.silu else None  # native.Layers' own rounding: the paths agree bitwise
    if a is None:
        gate, up = gu.chunk(2, dim=-1)
        a = layer.act(gate) * up
    y = layer.down(a)
    return layer.mlp_post_norm(y) if layer.mlp_post_norm is not None else y


def _logits(s: Stack, hidden: torch.Tensor) -> torch.Tensor:
    logits = s.lm_head(hidden)
    if s.final_softcap is not None:
        logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
    return logits.float()


def packs_trees(slot: object, pool: object) -> bool:
    """Whether ``forward_slots`` over slots like ``slot`` and their ``pool`` verifies token trees (``trees``):
    the native layers over a ``SlotPool``."""
    return _pool_tree_layers(slot, pool) is not None


def _pool_tree_layers(slot: object, pool: object) -> native.Layers | None:
    """The native layers that verify token trees in a packed pass over ``pool`` (``packs_trees``), else None."""
    return slot._tree_layers() if isinstance(pool, SlotPool) and isinstance(slot, Decoder) else None


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
    path's chain row as in ``Decoder.forward_tree``; ``settle_slots`` then puts the accepted paths' K/V in
    place."""
    if trees is not None and all(p is None for p in trees):
        trees = None
    if pool is not None and not isinstance(pool, SlotPool) and trees is None:
        return pool.forward_slots(slots, calls)
    s = slots[0].stack
    sizes = [ids.shape[0] for ids, _ in calls]
    h = Decoder._embed(s, torch.cat([ids for ids, _ in calls]))
    if trees is not None:
        return _forward_trees(slots, calls, trees, pool, h, sizes)
    per_call: list[_SlotCall] = []
    for slot, (ids, start) in zip(slots, calls):
        if slot.stack is not s:
            raise ValueError("forward_slots runs slots of one decoder (the same weights)")
        slot.cache.check(start + ids.shape[0])
        pos = torch.arange(start, start + ids.shape[0], device=ids.device)
        attn = slot._attention_for(ids.shape[0])
        per_call.append(_SlotCall(slot, pos, slice(start, start + ids.shape[0]), slot._spans(start, ids.shape[0], attn),
                                  slot._rope(pos, h), attn, {}))
    packed = _PooledAttention(per_call, pool) if pool is not None else None
    if packed is not None and packed.attn.name == NATIVE.name:  # every row alone, as in its own pass
        layers = slots[0]._layers_call(s)
        if layers is not None:
            cos, sin = slots[0].tables()[s.rope_keys[0]]
            if layers(h[0], packed.slots, packed.pos, cos, sin, pool.k, pool.v, None, s.scale):
                return list(_logits(s, s.norm(h)[0]).split(sizes))
    for i, layer in enumerate(s.layers):
        qkv = layer.qkv(layer.attn_norm(h))[0]
        if packed is not None:
            attended = packed(layer, i, qkv)
        else:
            parts = []
            for c, rows in zip(per_call, qkv.split(sizes)):
                if layer.window not in c.masks:
                    c.masks[layer.window] = _span_masks(c.attn, c.pos, c.spans, layer.window)
                parts.append(c.slot._attend(layer, i, rows, c.at, c.rope[layer.rope], c.attn, c.masks[layer.window]))
            attended = torch.cat(parts, dim=1)
        h = h + _attn_out(layer, attended)
        h = h + _mlp(layer, h)
    return list(_logits(s, s.norm(h)[0]).split(sizes))


def _forward_trees(slots: list[Decoder], calls: list[tuple[torch.Tensor, int]], trees: list[tuple[int, ...] | None],
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
    return list(_logits(s, s.norm(h)[0]).split(sizes))


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
        q, k, v = _heads(s, layer, qkv, self.rope[layer.rope])
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


class HFDecoder:
    """Fallback: plain HF forwards over a DynamicCache (any causal LM; no sub-layer skipping)."""

    can_skip, can_tree, can_batch, runs_ahead = False, False, False, False  # ``forms.DecoderForm``
    stack = None  # the model's own modules: no lean weights

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self.model = model
        self._new_cache = lambda: DynamicCache(config=model.config)
        self.cache = self._new_cache()
        self.n_layers = model.config.num_hidden_layers
        self.device = next(model.parameters()).device
        self.exactness = None

    def int8_stack(self):
        raise MaskError("this model runs on the plain HF fallback, which has no int8 draft weights")

    def reserve(self, n: int) -> None:
        pass

    def rollback(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.x: crop takes a negative count

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, mask: SkipMask | None = None, stack=None, last: bool = False,
                tap: int | None = None) -> Output:
        if mask is not None and mask.n_skipped:
            raise MaskError("this model runs on the plain HF fallback, which cannot skip sub-layers")
        if start == 0:
            self.cache = self._new_cache()
        self.rollback(start)
        if self.cache.get_seq_length() != start:
            raise RuntimeError(f"HF cache holds {self.cache.get_seq_length()} positions, call starts at {start}")
        out = self.model(
            input_ids=ids[None], past_key_values=self.cache, use_cache=True, output_hidden_states=True,
            logits_to_keep=1 if last else 0,
        )
        tapped = out.hidden_states[tap + 1][0] if tap is not None and tap >= 0 else None
        return Output(out.logits[0].float(), out.hidden_states[-1][0], tapped)


def make_decoder(model: torch.nn.Module, check: bool = True, record: Path | None = None,
                 weights: Callable[[Stack], Stack] | None = None) -> Decoder | HFDecoder:
    """The lean ``Decoder`` when the architecture is known and matches HF on a probe, else ``HFDecoder``.

    Either way the verify pass is probed for exactness (``exactness.py``) and the result kept in
    ``decoder.exactness``; the lean decoder also takes the exact attention the probe ranks first.
    With a ``record``, a lean decoder that is exact and agrees with HF is remembered, and the next
    load on the same machine key takes both from the record instead of measuring them again.
    ``weights``: what the lean decoder runs instead of the model's own weights (``quantized``'s blocks); the
    lean forward is checked against HF on the model's own weights first (blocks made at load differ from them
    by design: a tiny model's Q4_1 logits moved by 1.8), and the probe measures the blocks.
    """
    from knnssd.engine.model import exactness

    try:
        dec = Decoder(from_hf(model))
    except UnsupportedArchitecture as e:
        log.warning("lean forward unavailable (%s); using plain HF forwards (no layer skipping)", e)
        return _fallback(model)
    checked = False
    if weights is not None:
        if check:
            err = probe_error(dec, model)
            if err is not None:
                log.warning("lean forward differs from HF on %s (%s); using plain HF forwards", type(model).__name__,
                            err)
                return _fallback(model)
            checked = True
        dec.use_stack(weights(dec.stack))
    dec.exactness = exactness.choose(dec, record=record, packed=forward_slots)
    if check and not checked and not dec.exactness.recalled:  # a record is written only after this check has passed
        err = probe_error(dec, model)
        if err is not None:
            log.warning("lean forward differs from HF on %s (%s); using plain HF forwards", type(model).__name__, err)
            return _fallback(model)
    if record is not None and check:
        exactness.remember(record, dec.exactness)
    return dec


def _fallback(model: torch.nn.Module) -> "HFDecoder":
    from knnssd.engine.model import exactness

    dec = HFDecoder(model)
    dec.exactness = exactness.probe_fixed(dec, "hf")
    return dec


@torch.inference_mode()
def probe_error(dec: Decoder, model: torch.nn.Module) -> str | None:
    """Compare lean and HF logits for a prefill, a one-token step and a 3-token step; None if they agree."""
    from transformers import DynamicCache

    vocab = dec.stack.embed.shape[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (10,), generator=gen).to(dec.stack.device)
    cache = DynamicCache(config=model.config)
    tol = 1e-3 if dec.stack.dtype == torch.float32 else 5e-2
    for a, b in ((0, 6), (6, 7), (7, 10)):
        want = model(input_ids=ids[None, a:b], past_key_values=cache, use_cache=True).logits[0].float()
        got = dec.forward(ids[a:b], a).logits
        err = (got - want).abs().max().item()
        if not err <= tol * (1 + want.abs().max().item()):
            return f"max logit difference {err:.3g} at positions {a}..{b - 1}"
    return None
