"""The arithmetic of one decoder layer, shared by every forward form (``decoder.Decoder``, the packed
slot pass, token-tree passes and the static step): RoPE, the heads of a QKV projection, the attention
and MLP updates, the logits, and the masks of a call's spans of rows."""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from knnssd.engine.model import native
from knnssd.engine.model.attention import Attention
from knnssd.engine.model.cache import Span
from knnssd.engine.model.weights import Layer, Stack


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """RoPE on (T, heads, D): x*cos + rotate_half(x)*sin, with rotate_half(x)*sin = roll(x, D/2)*sin_signed.

    cos, sin_signed: (T, 1, d); d < D rotates only the first d dims (partial rotary, Phi3 style).
    One C call on the CPU where ``native`` is built (the same roundings), else four torch ops.
    """
    y = native.rope(x, cos, sin_signed)
    return rotate(x, cos, sin_signed) if y is None else y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in torch ops alone (what a compiled or captured step runs)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + x.roll(d // 2, -1) * sin_signed
    xr = x[..., :d]
    return torch.cat((xr * cos + xr.roll(d // 2, -1) * sin_signed, x[..., d:]), dim=-1)


def relative(y: torch.Tensor, h: torch.Tensor) -> float:
    """Mean over tokens of ||y|| / ||h|| (float32 norms)."""
    return float((y.float().norm(dim=-1) / h.float().norm(dim=-1).clamp_min(1e-12)).mean())


def rope_pair(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's (1, T, d) cos/sin -> (T, 1, d) cos and sign-folded sin for ``apply_rope``."""
    half = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[0, :, None], sin_signed[0, :, None]


def embed(s: Stack, ids: torch.Tensor) -> torch.Tensor:
    """(1, T, E): the embeddings of ``ids`` (T,), scaled where the architecture scales them."""
    h = F.embedding(ids, s.embed)[None]
    return h * s.embed_scale if s.embed_scale is not None else h


@functools.cache
def one_slot(rows: int) -> torch.Tensor:
    """The slot index of each row of a one-sequence native call: all 0."""
    return torch.zeros(rows, dtype=torch.long)


def rotary(s: Stack, x: torch.Tensor, pos: torch.Tensor, key: str):
    return s.rotary(x, pos) if key == "all" else s.rotary(x, pos, key)


def rope_tables(s: Stack, length: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each rotary key's cos and signed sin (length, 1, d) for positions 0..length-1 (``apply_rope``'s operands),
    for a stack whose tables depend on the position alone (``Stack.rope_static``)."""
    pos = torch.arange(length, device=s.device)[None]
    dummy = torch.empty(0, dtype=s.dtype, device=s.device)
    return {key: rope_pair(*rotary(s, dummy, pos, key)) for key in s.rope_keys}


class SpanMask(NamedTuple):
    """A span of a call's rows and its mask (``Attention.mask``) over the keys they read."""

    span: Span
    mask: object


def span_masks(attn: Attention, pos: torch.Tensor, spans: tuple[Span, ...], window: int | None
                ) -> tuple[SpanMask, ...]:
    return tuple(SpanMask(sp, attn.mask(pos[sp.lo : sp.hi], sp.keys, window)) for sp in spans)


def heads(s: Stack, layer: Layer, qkv: torch.Tensor, rope, rope_fn: Callable = apply_rope
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


def attn_out(layer: Layer, attended: torch.Tensor) -> torch.Tensor:
    """The attention sub-layer's update from its heads' output (1, T, H D): projection, post-norm."""
    o = layer.o(attended)
    return layer.attn_post_norm(o) if layer.attn_post_norm is not None else o


def mlp(layer: Layer, h: torch.Tensor) -> torch.Tensor:
    gu = layer.gate_up(layer.mlp_norm(h))
    a = native.silu_mul(gu) if layer.silu else None  # native.Layers' own rounding: the paths agree bitwise
    if a is None:
        gate, up = gu.chunk(2, dim=-1)
        a = layer.act(gate) * up
    y = layer.down(a)
    return layer.mlp_post_norm(y) if layer.mlp_post_norm is not None else y


def logits(s: Stack, hidden: torch.Tensor) -> torch.Tensor:
    logits = s.lm_head(hidden)
    if s.final_softcap is not None:
        logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
    return logits.float()
