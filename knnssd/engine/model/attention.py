"""Attention over the static KV cache, in the implementations the exactness probe chooses from.

Terms: T queries at positions ``pos`` (T,), H query heads in KV groups of G = H / KV, D head
dim, L the key length the call reads (``KVCache.keys``: set by the queries' positions, so the same
for a row of a pass and the one-token step at its position). Every implementation maps
q (T, H, D) and the cache views k, v (1, KV, L, D) to (1, T, H * D); query t sees key j iff
j <= pos[t] (and j > pos[t] - window for a sliding-window layer).

Which one gives the rows of a T-token pass bitwise equal to T one-token steps depends on the
device, the dtype and the model's shapes (``exactness.py`` measures it at load):

    sdpa          SDPA over all L keys with a position mask (``PositionMask``)
    sdpa_fold     the same, with the G query heads of each KV head folded into rows: one
                  (G * T, L) score matrix per KV head, no repeated K/V; ``folded(4)`` pads
                  those rows to a multiple of 4 (``sdpa_fold_r4``)
    fp32          fp32 bmm, additive -inf mask, softmax, bmm over all L keys (static shapes;
                  the cache is kept in fp32 so nothing is converted per call)
    sdpa_dynamic  the pre-static step: SDPA over keys 0..pos[-1] only, no mask for T = 1
                  (shapes change with the position; needs the position on the host); a fresh
                  prefill runs it causal (``native.causal`` where the native linear runs, else
                  in blocks of matrix products on the CPU in bf16, ``causal_blocks``), as does
                  the rest of a prompt whose first positions' K/V were copied from another
                  sequence (``loop.Reused``)
    native        the C kernel of ``native.py`` (CPU, where it is built): each query row alone,
                  reading its keys 0..pos only, in fp32 with one rounding (in bf16 on avx512_bf16,
                  in ``native.causal``'s arithmetic instead), so invariant to the
                  call's rows and to the key length by construction; a packed pass over a
                  ``SlotPool`` is one call per layer (``Attention.pooled``), whatever the key lengths

and ``padded(impl, R)`` of the static ones: the queries of a call with fewer than R tokens are
padded with zero rows to R (gpt-fast's verification at a fixed length), so one-token steps and
short verify passes run the kernel shape of longer ones. On the CPU they were first measured on
(docs/benchmarks.md) only padded ones were row-invariant in the whole model: ``sdpa_pad4``, ``sdpa_fold_r4`` and
``fp32_pad2`` in bf16 and fp32 (the kernels take another path below a few query rows), while in
isolation, on random inputs, plain ``sdpa`` was; so the probe runs the real model.

Each static one but ``sdpa_dynamic`` also has a batched form (``Attention.batch``): the same
arithmetic over B sequences' caches at one key length, for the batched engine's packed passes.
There it gave rows bitwise equal to one sequence's call for any B and any
padded query count, but not for a longer key length (the P @ V reduction over L rounds
differently), so a packed pass makes one call per key length (``packed._PooledAttention``), and
``plan.pooled_exact`` checks it on the real model before a batch uses it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from knnssd.engine.model import native, native_library


def allowed(pos: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """(..., length) bool: the query at each position of ``pos`` (T,), or (B, R), may read key j."""
    k = torch.arange(length, device=pos.device)
    q = pos[..., None]
    ok = k <= q
    if window is not None:
        ok &= k > q - window
    return ok


class PositionMask:
    """The keys each query row may read (``ok``, bool), built once per call and window and shared by its
    layers, with the forms attention reads derived from it once too (``memo``): SDPA is given the 0 / -inf
    float mask (``additive``), since it converts a boolean one again on every call (on the CPU bitwise
    the same result, and less per call; CUDA's cuDNN
    backend fills a boolean mask with a finite value instead, so there the forms may round apart: the
    exactness probe compares runs that both use this one)."""

    def __init__(self, ok: torch.Tensor):
        self.ok = ok
        self._memo: dict = {}

    def memo(self, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        return self.memo(dtype, lambda: to_additive(self.ok, dtype))


def to_additive(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the float mask SDPA makes of it: 0 where allowed, -inf elsewhere."""
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, float("-inf"))


def _position_mask(pos, length, window) -> PositionMask:
    return PositionMask(allowed(pos, length, window))


def _sdpa(q, k, v, mask: PositionMask, scale):
    T, H, D = q.shape
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask.additive(q.dtype), scale=scale,
                                       enable_gqa=H != k.shape[1])
    return o.transpose(1, 2).reshape(1, T, H * D)


def folded(rows: int = 1) -> "Attention":
    """SDPA with the G query heads of each KV head folded into rows, g-major (g, t): one (R, L) score
    matrix per KV head and no repeated K/V. The G*T rows are padded with zero rows to R, a multiple
    of ``rows``: the CPU kernel takes query rows in blocks of up to 32 and rounds a block of one to
    three rows differently, so with ``rows`` = 4 no block is that short (a one-token step is 3 rows
    of SmolLM2, padded to 4; an 11-token pass 33, padded to 36)."""

    def fold(ok: torch.Tensor, G: int, P: int) -> torch.Tensor:
        """(..., T, L) -> (..., G * T + P, L): the rows repeated per query head g (g-major), then P padding
        rows that see what the first row sees (never a row with no visible key)."""
        mg = ok.repeat(*(1,) * (ok.dim() - 2), G, 1)
        return torch.cat((mg, mg[..., :1, :].expand(*mg.shape[:-2], P, -1)), -2) if P else mg

    def attend(q, k, v, m: PositionMask, scale):
        T, H, D = q.shape
        KV = k.shape[1]
        G = H // KV
        R = -(-G * T // rows) * rows
        one = T == 1  # a one-token step: (1, H, D) is already (1, KV, G, D), so no permutes
        qg = q.reshape(1, KV, G, D) if one else q.reshape(T, KV, G, D).permute(1, 2, 0, 3).reshape(1, KV, G * T, D)
        if R > G * T:
            qg = F.pad(qg, (0, 0, 0, R - G * T))
        mg = m.memo(("fold", G, q.dtype), lambda: to_additive(fold(m.ok, G, R - G * T), q.dtype))
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mg, scale=scale)[0, :, : G * T]
        return o.reshape(1, 1, H * D) if one else o.reshape(KV, G, T, D).permute(2, 0, 1, 3).reshape(1, T, H * D)

    def batch(q, k, v, m: PositionMask, scale):  # as ``attend``, over B sequences (``Attention.batch``)
        B, R, H, D = q.shape
        KV = k.shape[1]
        G = H // KV
        P = -(-G * R // rows) * rows
        qg = q.view(B, R, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B, KV, G * R, D)
        if P > G * R:
            qg = F.pad(qg, (0, 0, 0, P - G * R))
        mg = m.memo(("fold", G, q.dtype), lambda: to_additive(fold(m.ok, G, P - G * R), q.dtype))  # (B, 1, P, L)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mg, scale=scale)
        return o[:, :, : G * R].reshape(B, KV, G, R, D).permute(0, 3, 1, 2, 4).reshape(B, R, H * D)

    return Attention("sdpa_fold" if rows == 1 else f"sdpa_fold_r{rows}", _position_mask, attend, cache_fp32=False,
                     static=True, batch=batch)


def _sdpa_batch(q, k, v, mask: PositionMask, scale):
    """``_sdpa`` over B sequences at once: q (B, R, H, D), k/v (B, KV, L, D), a mask of (B, 1, R, L) ->
    (B, R, H * D)."""
    B, R, H, D = q.shape
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.additive(q.dtype), scale=scale,
                                       enable_gqa=H != k.shape[1])
    return o.transpose(1, 2).reshape(B, R, H * D)


def _fp32_mask(pos, length, window):
    return to_additive(allowed(pos, length, window), torch.float32)


def _fp32(q, k, v, mask, scale):
    T, H, D = q.shape
    KV = k.shape[1]
    G = H // KV
    qg = q.float().view(T, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * T, D)  # rows g-major: (g, t)
    s = torch.bmm(qg, k[0].float().transpose(1, 2)).mul_(scale).view(KV, G, T, -1).add_(mask)
    p = s.softmax(-1).view(KV, G * T, -1)
    o = torch.bmm(p, v[0].float()).view(KV, G, T, D).permute(2, 0, 1, 3).reshape(1, T, H * D)
    return o.to(q.dtype)


def _fp32_batch(q, k, v, mask: PositionMask, scale):
    """``_fp32`` over B sequences at once (shapes as ``_sdpa_batch``): one bmm over the B * KV heads."""
    B, R, H, D = q.shape
    KV, L = k.shape[1], k.shape[2]
    G = H // KV
    add = mask.additive(torch.float32)[:, :, None]  # (B, 1, 1, R, L)
    qg = q.float().view(B, R, KV, G, D).permute(0, 2, 3, 1, 4).reshape(B * KV, G * R, D)
    s = torch.bmm(qg, k.float().reshape(B * KV, L, D).transpose(1, 2)).mul_(scale).view(B, KV, G, R, L).add_(add)
    p = s.softmax(-1).view(B * KV, G * R, L)
    o = torch.bmm(p, v.float().reshape(B * KV, L, D)).view(B, KV, G, R, D).permute(0, 3, 1, 2, 4)
    return o.reshape(B, R, H * D).to(q.dtype)


class Causal(NamedTuple):
    """A ``_dynamic`` mask: the queries are positions start..end-1, each reading keys 0..itself, with
    ``start`` 0 (a fresh prefill) or, for more than ``PREFILL_ROWS`` queries, any position (the rest
    of a prompt whose first positions' K/V were copied from another sequence's prefill:
    ``loop.Reused``, at a multiple of ``reuse_unit``; a shorter call there is a verify pass, which
    must read its keys as the one-token steps do)."""

    start: int
    pos: torch.Tensor


def _dynamic_mask(pos, length, window):
    T, end = pos.shape[0], int(pos[-1]) + 1
    if T == 1:
        lo = end - window if window is not None and end > window else 0
        return slice(lo, end), None
    start = end - T
    if window is None and (start == 0 or T > PREFILL_ROWS):  # not a verify pass
        return slice(0, end), Causal(start, pos)
    return slice(0, end), _position_mask(pos, end, window)


def _blocked(q: torch.Tensor, end: int) -> bool:
    """Does a causal prefill ending at ``end`` run by blocks (``causal_blocks``)? On CPU in bf16, past one block."""
    return end > CAUSAL_BLOCK and q.device.type == "cpu" and q.dtype == torch.bfloat16


def _dynamic(q, k, v, mask, scale):
    keys, m = mask
    k, v = k[:, :, keys], v[:, :, keys]
    T, H, D = q.shape
    KV = k.shape[1]
    if m is None:  # one query: the G query heads of each KV head become rows (no repeated K/V, no mask)
        o = F.scaled_dot_product_attention(q[0].view(1, KV, H // KV, D), k, v, scale=scale)
        return o.reshape(1, 1, H * D)  # CUDA fp32 SDPA may return it strided
    if isinstance(m, Causal):
        o = native.causal(q, k, v, scale, m.start)  # where the native linear runs: its tiles, row by row
        if o is not None:
            return o
        if _blocked(q, m.start + T) and m.start % CAUSAL_BLOCK == 0:
            return causal_blocks(q, k, v, scale, m.start)
        if m.start:
            return _sdpa(q, k, v, _position_mask(m.pos, m.start + T, None), scale)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale,
                                           enable_gqa=H != KV)  # SDPA skips the masked blocks itself
        return o.transpose(1, 2).reshape(1, T, H * D)
    return _sdpa(q, k, v, m, scale)


CAUSAL_BLOCK = 128  # query rows per block of ``causal_blocks``


def reuse_unit(dtype: torch.dtype, device: torch.device | str, head_dim: int, step: "Attention") -> int:
    """The positions a prompt's rest may start at when its first ones are copied (``loop.reusable``):
    any, where its prefill computes each row alone, from any start (``native.causal``: where
    ``native.causal_runs``, with a bf16 cache, which a ``step`` that keeps fp32 K/V has not; or the
    ``native`` step itself, ``prefill_form``); else whole blocks of ``CAUSAL_BLOCK`` (``causal_blocks``'
    rows are the same from a block boundary)."""
    form = prefill_form(step, dtype, device)
    alone = form.pooled is not None or (form is SDPA_DYNAMIC and native.causal_runs(dtype, device, head_dim))
    return 1 if alone else CAUSAL_BLOCK


def causal_blocks(q, k, v, scale, start: int = 0, block: int = CAUSAL_BLOCK):
    """Causal attention of a prefill (query t reads keys 0..t; q (T, H, D) at positions start..start+T-1,
    k, v (1, KV, start+T, D)) as matrix products over blocks of ``block`` queries: each block's G query heads
    per KV head folded into rows, scores against the keys up to its end only, -inf above the diagonal,
    softmax, then P @ V. The blocks lie at multiples of ``block`` from position 0 (``start`` is one), so a
    block's rows come out of the same products whether the prefill started at 0 or at ``start``.

    The scores and probabilities are rounded to q's dtype, as in HF's eager attention, where SDPA keeps
    them in fp32; in bf16 it was faster than SDPA at every length measured, about as close to an fp32
    run, and in fp32 slower, so fp32 keeps SDPA (as does fp16, not measured; docs/benchmarks.md). Where the native linear runs,
    ``native.causal`` takes the prefill instead (about twice as fast; any start, no blocks)."""
    if start % block:
        raise ValueError(f"causal_blocks: start {start} is not a multiple of the block ({block})")
    T, H, D = q.shape
    KV = k.shape[1]
    G = H // KV
    above = torch.full((block, block), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)[None, :, None, :]
    qg = (q * scale).view(T, KV, G, D).transpose(0, 1).reshape(KV, T * G, D)  # rows (t, g) per KV head
    out = torch.empty(T, KV, G, D, dtype=q.dtype, device=q.device)
    for a in range(0, T, block):
        b = min(T, a + block)
        n, end = b - a, start + b
        s = torch.bmm(qg[:, a * G : b * G], k[0, :, :end].transpose(1, 2))  # (KV, n G, end)
        s.view(KV, n, G, end)[..., start + a : end] += above[:, :n, :, :n]
        out[a:b] = torch.bmm(torch.softmax(s, -1), v[0, :, :end]).view(KV, n, G, D).transpose(0, 1)
    return out.view(1, T, H * D)


@dataclass(frozen=True)
class Attention:
    name: str
    mask: Callable  # (pos, length, window) -> whatever ``attend`` takes; built once per call and window
    attend: Callable  # (q, k, v, mask, scale) -> (1, T, H * D)
    cache_fp32: bool  # keep K/V in fp32
    static: bool  # shapes are set by the key length, not the positions (CUDA-graph capturable per key length)
    # The same arithmetic over several sequences' caches at one key length, for packed passes
    # (``packed.forward_slots``): (q (B, R, H, D), k, v (B, KV, L, D), mask (a PositionMask of (B, 1, R, L)), scale) ->
    # (B, R, H * D), the queries padded to R >= ``rows``. None: no batched form.
    batch: Callable | None = None
    rows: int = 1
    # Each query row reads its own keys and nothing else, whatever the key length or the other rows (so a
    # call needs no split at key-length boundaries, and a packed pass one call per layer): the rows' form
    # of the mask, (slots (R,), pos (R,), window) -> what ``pooled`` takes, and ``pooled`` itself,
    # (q (R, H, D), k, v (S, KV, L, D) a pool's buffers, rows, scale) -> (R, H * D). None: no such form.
    pooled_rows: Callable | None = None
    pooled: Callable | None = None

    @property
    def poolable(self) -> bool:
        """Has a form for a packed pass over a ``SlotPool`` (``batch`` or ``pooled``)."""
        return self.batch is not None or self.pooled is not None


def _native_mask(pos, length, window):
    return native.Rows(torch.zeros_like(pos), pos, window)


def _native_pooled(q, k, v, rows: native.Rows, scale):
    out = native.attention(q, k, v, rows, scale)
    if out is None:
        raise RuntimeError(f"the native attention kernel refused q {tuple(q.shape)} {q.dtype} on {q.device} with a "
                           f"cache of {tuple(k.shape)} {k.dtype} (another layout, or a row outside the cache)")
    return out


def _native(q, k, v, rows: native.Rows, scale):
    return _native_pooled(q, k, v, rows, scale)[None]


# The C kernel (``native.c``): each query row alone, reading keys 0..pos only, in fp32 with one rounding; in bf16
# on avx512_bf16, in the native prefill's arithmetic (``native.causal``), whose row it equals bit for bit.
NATIVE = Attention("native", _native_mask, _native, cache_fp32=False, static=True,
                   pooled_rows=native.Rows, pooled=_native_pooled)

PREFILL_ROWS = 16  # longer calls are prefills: ``decoder.Decoder`` runs them in ``prefill_form``
SDPA = Attention("sdpa", _position_mask, _sdpa, cache_fp32=False, static=True, batch=_sdpa_batch)
SDPA_FOLD = folded()
FP32 = Attention("fp32", _fp32_mask, _fp32, cache_fp32=True, static=True, batch=_fp32_batch)
SDPA_DYNAMIC = Attention("sdpa_dynamic", _dynamic_mask, _dynamic, cache_fp32=False, static=False)


def prefill_form(step: Attention, dtype: torch.dtype, device: torch.device | str) -> Attention:
    """The attention a prefill (a call of more than ``PREFILL_ROWS`` rows) runs, given the decoder's ``step``.
    A prefill's rows are never compared with one-token steps (plain and speculative runs share it), so it
    may run another form than the step, for the cache the step keeps:

    - the step itself where it keeps fp32 K/V (the cache's dtype);
    - the step itself where it is ``native`` in fp32 on the CPU, for reuse rather than speed: each row
      alone, over its own keys, so a prefill row is a step row and the same from any start (``reuse_unit``),
      where causal SDPA rounds a row by the prompt's length; it costs about what causal SDPA does, the
      linears taking most of a prefill (docs/benchmarks.md);
    - the step itself where it is ``native`` in bf16 on a CPU without ``native.causal`` (no avx512_bf16):
      there torch's bf16 matrix products, which ``causal_blocks`` and SDPA run on, have no fast kernel (a
      256-token prefill on AVX2 took several times the step's own attention row by row, docs/benchmarks.md),
      and a prefill row is a step row as in fp32;
    - else the fastest causal form, ``SDPA_DYNAMIC`` (``native.causal`` where it runs, causal blocks in
      bf16, causal SDPA)."""
    native_step = step.pooled is not None and torch.device(device).type == "cpu"
    if step.cache_fp32 or (native_step and (dtype == torch.float32 or native_library.tiled("causal") is None)):
        return step
    return SDPA_DYNAMIC


def padded(impl: Attention, rows: int) -> Attention:
    """``impl`` with the queries of calls shorter than ``rows`` padded to ``rows`` (prefills are not padded)."""

    def mask(pos, length, window):
        T = pos.shape[0]
        if T < rows:  # padding rows sit at the first query's position: never a row with no visible key
            pos = torch.cat((pos, pos[:1].expand(rows - T)))
        return T, impl.mask(pos, length, window)

    def attend(q, k, v, m, scale):
        T, inner = m
        if T < rows:
            q = torch.cat((q, q.new_zeros(rows - T, *q.shape[1:])))
        return impl.attend(q, k, v, inner, scale)[:, :T]

    return Attention(f"{impl.name}_pad{rows}", mask, attend, impl.cache_fp32, impl.static, impl.batch, rows)


def implementations(rows: int, device: torch.device | str = "cpu") -> tuple[Attention, ...]:
    """The candidates the exactness probe measures, for passes of up to ``rows`` tokens on ``device``: the
    plain ones, then padded forms from the cheapest (2 rows) to the surest (``rows``: every call one
    shape), and on the CPU, where the native kernels are built, ``native``."""
    pads = sorted({p for p in (2, 4, rows) if 1 < p <= rows})
    own = (NATIVE,) if torch.device(device).type == "cpu" and native_library.available() else ()
    return (SDPA, SDPA_FOLD, FP32, SDPA_DYNAMIC, *(padded(impl, p) for p in pads for impl in (SDPA, FP32)),
            folded(4), *own)
