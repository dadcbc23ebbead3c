"""The full-model pass and the layer-skip draft step at fixed shapes: functions of device tensors only,
so that ``torch.compile(fullgraph=True, dynamic=False)`` takes them whole and a CUDA graph can replay
them (``graphs.py``).

Terms:
    R   rows of a step: tokens of one or several sequences, padded up to a bucket (``ROW_BUCKETS``)
    S   slots of the static cache; the last one is scratch, which padding rows write and read
    L   positions a slot holds (the cache's length, fixed when it is made)
    K   positions a step's rows attend over: a key bucket, at most L
    H, KV, D  query heads, key/value heads, head dim; E hidden size; V vocabulary

``step`` runs R rows, row r being token ``ids[r]`` of the sequence in slot ``slots[r]`` at position
``pos[r]``. It writes each row's K/V into its slot, then each row attends, alone, over the first K
positions of its slot (K a key bucket, ``keys_bucket``, at least every row's position + 1) with a mask
built on the device from its position (``attention.allowed``). A short sequence in a long cache so reads
a few hundred keys, not L. So a plain step (one row), a verify pass (T rows of one slot) and a packed pass
(rows of many slots) are one function at different buckets, and a row's attention is the same call
whatever the other rows are. Inside: no host
read, no Python branch on a tensor's value, no tensor of a new shape per call. A skip mask is a Python
constant: each mask is its own graph.

The step runs the torch ops only: ``plain`` strips the CPU's native kernels from a ``Stack`` (their
ctypes calls would break the graph), so on the CPU this form serves to prove the step compiles whole,
not to be fast; the decoding loop on the CPU keeps ``decoder.Decoder``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from knnssd.engine.model.attention import allowed, to_additive
from knnssd.engine.model.layers import attn_out, embed, heads, logits, mlp, rope_tables, rotate
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.weights import Int8Linear, Layer, Linear, Norm, PackedLinear, Stack, UnsupportedArchitecture

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LEAST_KEYS = 512  # the smallest key bucket (each next one doubles, up to the cache's length): it holds the
# exactness probe's longest context, so the probe can check every bucket


def rows_bucket(rows: int) -> int:
    """The smallest bucket holding ``rows`` rows."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    raise ValueError(f"a static step takes at most {ROW_BUCKETS[-1]} rows, not {rows}")


def keys_bucket(positions: int, length: int) -> int:
    """The smallest key bucket holding ``positions`` positions of a cache of ``length``: LEAST_KEYS, doubled
    until it holds them, at most ``length``."""
    if positions > length:
        raise ValueError(f"{positions} positions do not fit a static cache of {length}")
    b = LEAST_KEYS
    while b < positions:
        b *= 2
    return min(b, length)


def keys_buckets(length: int) -> list[int]:
    """Every key bucket of a cache of ``length`` positions, smallest first."""
    out = [keys_bucket(1, length)]
    while out[-1] < length:
        out.append(keys_bucket(out[-1] + 1, length))
    return out


def plain(s: Stack) -> Stack:
    """The same weights with torch ops only: dense linears, norms without the native kernel, the MLP's product
    in torch. Raises ``UnsupportedArchitecture`` for a stack whose rotary tables depend on the sequence
    length (they could not be tables of the position)."""
    if not s.rope_static:
        raise UnsupportedArchitecture("a static step needs rotary tables set by position alone")

    def linear(lin) -> Linear:
        lin = getattr(lin, "inner", lin)  # a RowPadded's own linear
        if isinstance(lin, Int8Linear):
            raise UnsupportedArchitecture("a static step runs full-precision weights")
        if isinstance(lin, PackedLinear):
            return Linear(lin.packed_weight.to_dense(), lin.bias)
        return Linear(lin.weight, lin.bias)

    def norm(n: Norm | None) -> Norm | None:
        if n is None:
            return None
        out = dataclasses.replace(n)
        out.kernel = None
        return out

    def layer(x: Layer) -> Layer:
        return dataclasses.replace(
            x, attn_norm=norm(x.attn_norm), mlp_norm=norm(x.mlp_norm), q_norm=norm(x.q_norm), k_norm=norm(x.k_norm),
            attn_post_norm=norm(x.attn_post_norm), mlp_post_norm=norm(x.mlp_post_norm), silu=False,
            qkv=linear(x.qkv), o=linear(x.o), gate_up=linear(x.gate_up), down=linear(x.down))

    return dataclasses.replace(s, layers=[layer(x) for x in s.layers], norm=norm(s.norm), lm_head=linear(s.lm_head))


class StaticCache:
    """K and V of ``slots`` sequences and one scratch slot, ``length`` positions each: (S, KV, L, D) per layer,
    allocated once; and the rotary tables for those positions."""

    def __init__(self, s: Stack, slots: int, length: int, dtype: torch.dtype | None = None):
        self.slots, self.length = slots, length
        shape = (slots + 1, s.n_kv, length, s.head_dim)
        dtype = dtype or s.dtype
        self.k = [torch.zeros(shape, dtype=dtype, device=s.device) for _ in s.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=s.device) for _ in s.layers]
        self.tables = rope_tables(s, length)

    @property
    def scratch(self) -> int:
        """The slot padding rows use."""
        return self.slots

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def step(s: Stack, k: list[torch.Tensor], v: list[torch.Tensor], tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
         ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, skip: SkipMask | None = None,
         slot: int | None = None, keys: int | None = None, tap: int | None = None) -> tuple[torch.Tensor, ...]:
    """Logits (R, V) float32 and final-normed hidden states (R, E) of R rows, and with ``tap`` the residual
    stream after layer ``tap`` (R, E) too; writes their K/V into ``k``, ``v`` (for the layers whose attention
    runs).

    s: a ``plain`` stack. k[i], v[i]: (S, KV, L, D), layer i's cache. tables[key]: (cos (L, 1, d), signed sin
    (L, 1, d)). ids, pos, slots: (R,) long. skip: sub-layers to skip (a draft step), or None (the full model).
    slot: where every real row is of one sequence, its slot (a constant, so a graph of its own): the rows then
    read that slot's keys as one view, where rows of several slots each read a copy of their own slot's.
    keys: K, the positions every row attends over (a constant: a graph each), more than any row's position;
    None: all L. tap: a layer (a constant), for a prompt's routing vector (``loop.prefill``).
    """
    length = keys or k[0].shape[2]
    h = embed(s, ids)  # (1, R, E)
    rope = {key: (cos[pos], sin[pos]) for key, (cos, sin) in tables.items()}  # (R, 1, d) each
    masks: dict[int | None, torch.Tensor] = {}  # by window: (R, 1, 1, K), 0 / -inf
    for i, layer in enumerate(s.layers):
        if skip is None or not skip.attn[i]:
            if layer.window not in masks:
                masks[layer.window] = to_additive(allowed(pos, length, layer.window), k[i].dtype)[:, None, None]
            h = h + attn_out(layer, _attend(s, layer, i, h, k, v, rope[layer.rope], masks[layer.window], pos, slots,
                                             slot, length))
        if skip is None or not skip.mlp[i]:
            h = h + mlp(layer, h)
        if i == tap:
            tapped = h[0]
    hidden = s.norm(h)[0]
    return (logits(s, hidden), hidden) if tap is None else (logits(s, hidden), hidden, tapped)


def _attend(s: Stack, layer: Layer, i: int, h: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], rope,
            mask: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, slot: int | None, length: int) -> torch.Tensor:
    """(1, R, H D): every row's K/V written at (slot, position), then each row's queries alone over its slot's
    first ``length`` keys, each KV head's G = H / KV query heads as its rows (no repeated K/V, and no
    ``enable_gqa``, which not every CUDA kernel takes)."""
    q, kr, vr = heads(s, layer, layer.qkv(layer.attn_norm(h))[0], rope, rope_fn=rotate)  # (R, H, D), (R, KV, D)
    k[i][slots, :, pos] = kr.to(k[i].dtype)
    v[i][slots, :, pos] = vr.to(v[i].dtype)
    R = q.shape[0]
    ki, vi = k[i][:, :, :length], v[i][:, :, :length]  # (S, KV, K, D) views
    if slot is None:
        keys, values = ki.index_select(0, slots), vi.index_select(0, slots)  # (R, KV, K, D), copied
    else:
        keys, values = ki[slot : slot + 1].expand(R, -1, -1, -1), vi[slot : slot + 1].expand(R, -1, -1, -1)
    q = q.view(R, s.n_kv, s.n_heads // s.n_kv, s.head_dim).to(keys.dtype)  # (R, KV, G, D)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=s.scale)  # (R, KV, G, D)
    return out.reshape(1, R, -1).to(h.dtype)
