"""The lean forward pass (``Decoder``) over ``weights.Stack`` tensors and a KV cache that rolls back
exactly, with or without a ``skip.SkipMask``: gpt-fast's shape, one sequence at a time.

Its other jobs have rooms of their own: several sequences' rows in one pass (``packed``), token-tree
passes (``tree_pass``), the plain HF fallback (``hf_decoder``), and choosing and probing a decoder for
a model (``build``). The layer arithmetic they share is ``layers``.
"""
from __future__ import annotations

import copy

import torch

from knnssd.engine.model import native
from knnssd.engine.model.attention import NATIVE, PREFILL_ROWS, SDPA, Attention, prefill_form
from knnssd.engine.model.cache import KVCache, SlotPool, Span
from knnssd.engine.model.forms import Output
from knnssd.engine.model.layers import (SpanMask, attn_out, embed, heads, logits, mlp, one_slot,
                                        relative, rope_pair, rope_tables, rotary, span_masks)
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.weights import Layer, Stack, native_layers


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
        attn = self.attention_for(T)
        if isinstance(start, torch.Tensor):
            pos = at = start
            spans = (Span(0, T, self.cache.length),)
        else:
            if start == 0 and T > self.cache.length:  # a fresh sequence nobody reserved for
                self.reserve(T)
            self.cache.check(start + T)
            pos, at = torch.arange(start, start + T, device=ids.device), slice(start, start + T)
            spans = self.spans(start, T, attn)
        h = embed(s, ids)
        if tap is None and not influence and isinstance(at, slice) and self._one_call(s, attn, h, pos, mask):
            hidden = s.norm(h)[0]
            return Output(logits(s, hidden[-1:] if last else hidden), hidden)
        rope = self.rope_at(pos, h)
        masks: dict[int | None, object] = {}
        skip_a = mask.attn if mask is not None else None
        skip_m = mask.mlp if mask is not None else None
        sizes = torch.zeros(2, len(s.layers)) if influence else None
        for i, layer in enumerate(s.layers):
            if skip_a is None or not skip_a[i]:
                if layer.window not in masks:
                    masks[layer.window] = span_masks(attn, pos, spans, layer.window)
                y = self._attention(layer, i, h, at, rope[layer.rope], attn, masks[layer.window])
                if sizes is not None:
                    sizes[0, i] = relative(y, h)
                h = h + y
            if skip_m is None or not skip_m[i]:
                y = mlp(layer, h)
                if sizes is not None:
                    sizes[1, i] = relative(y, h)
                h = h + y
            if i == tap:
                tapped = h[0]
        hidden = s.norm(h)[0]
        return Output(logits(s, hidden[-1:] if last else hidden), hidden, tapped, sizes)

    def layers_call(self, s: Stack) -> native.Layers | None:
        if id(s) not in self._native:
            self._native[id(s)] = (s, native_layers(s))  # the stack kept: its id is not reused while here
        return self._native[id(s)][1]

    def _one_call(self, s: Stack, attn: Attention, h: torch.Tensor, pos: torch.Tensor, mask: SkipMask | None) -> bool:
        """Run the layers of a step or verify pass as one native call (``native.Layers``) where it applies: the
        native attention step, whose rows it computes bit for bit, at positions known on the host. h
        (1, T, E) is updated in place; False where the call does not apply (h untouched)."""
        if attn.name != NATIVE.name or h.shape[1] > PREFILL_ROWS or not s.rope_static:
            return False
        layers = self.layers_call(s)
        if layers is None:
            return False
        cos, sin = self.tables()[s.rope_keys[0]]
        skip = None if mask is None else (mask.attn, mask.mlp)
        return layers(h[0], one_slot(h.shape[1]), pos, cos, sin, self.cache.k, self.cache.v, skip, s.scale)

    def spans(self, start: int, rows: int, attn: Attention) -> tuple[Span, ...]:
        """The key lengths a call's rows read (``KVCache.spans``); a prefill's rows are never compared with
        one-token steps, so a long one reads one length, its last position's, as does a step whose shapes
        follow the positions anyway (``sdpa_dynamic``)."""
        if rows > PREFILL_ROWS or not attn.static or attn.pooled is not None:  # the last: rows read their own keys
            return (Span(0, rows, self.cache.keys(start + rows)),)
        return self.cache.spans(start, rows)

    def attention_for(self, rows: int) -> Attention:
        """The probed step; for a prefill, ``attention.prefill_form``."""
        if rows > PREFILL_ROWS:
            return prefill_form(self.attention, self.stack.dtype, self.device)
        return self.attention

    def _attention(self, layer: Layer, i: int, h: torch.Tensor, at: torch.Tensor | slice, rope, attn: Attention,
                   masks: tuple["SpanMask", ...]) -> torch.Tensor:
        return attn_out(layer, self.attend(layer, i, layer.qkv(layer.attn_norm(h))[0], at, rope, attn, masks))

    def attend(self, layer: Layer, i: int, qkv: torch.Tensor, at: torch.Tensor | slice, rope, attn: Attention,
                masks: tuple["SpanMask", ...]) -> torch.Tensor:
        """Attention of one sequence's rows, from their QKV projection (T, (H + 2 KV) D): writes their K/V to
        this decoder's cache at positions ``at`` (``KVCache.write``), then runs one attention call per span
        of rows (``masks``), over the keys it reads, and returns (1, T, H D), before the output projection."""
        q, k, v = heads(self.stack, layer, qkv, rope)
        kc, vc = self.cache.write(i, at, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        scale = self.stack.scale
        if len(masks) == 1:  # the common case: no slicing of the queries
            (sp, m), = masks
            return attn.attend(q, kc[:, :, : sp.keys], vc[:, :, : sp.keys], m, scale)
        return torch.cat([attn.attend(q[sp.lo : sp.hi], kc[:, :, : sp.keys], vc[:, :, : sp.keys], m, scale)
                          for sp, m in masks], dim=1)

    def rope_at(self, pos: torch.Tensor, h: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        s = self.stack
        if not s.rope_static:  # e.g. dynamic NTK / longrope: cos/sin depend on the sequence length
            return {key: rope_pair(*rotary(s, h, pos[None], key)) for key in s.rope_keys}
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
