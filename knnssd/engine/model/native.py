"""The C kernels of the CPU step (``native.c``) as torch-facing calls: each returns None where its kernel
does not run here, and the caller keeps its torch ops.

A torch op costs a few microseconds of dispatch on the CPU whatever its size. RMSNorm is about
eight of them (F.rms_norm's composite: upcast, square, mean, add, rsqrt, two products, downcast)
and RoPE four (two products, a roll, a sum). A one-token step runs two norms and a RoPE a layer,
so their dispatch was a visible share of it; one C call each costs a fraction of that.

Each kernel computes every row alone with one fixed loop (``native.c``), so its rows do not depend
on the call's row count (the exactness probe still measures the whole step). The norm and RoPE run
on one thread; at a prefill's rows they still cost no more than the torch ops on two. Attention
shares its rows x KV heads out among torch's threads where the library is built with OpenMP
(``openmp_flags``): each item is computed by one thread with the same loop, so the threads change
no bit. The library is built and loaded by ``native_library`` (``library()`` is None where
it cannot be: callers then keep the torch ops).

The linears have a kernel too (``Linear``), in bf16, wherever the library has a vector instruction set
(``kernel_path``): on AMX CPUs on AMX's tiles (``tdpbf16ps``), on avx512_bf16 on ``vdpbf16ps``; on AVX-512F,
AVX2 with FMA and ARM64's NEON the bf16 (and int8) weights are widened to fp32 in registers and summed by fused multiply-adds,
reading half fp32's bytes. GGUF's 4-bit and 8-bit blocks take their inputs in 8-bit blocks and sum them in
integers on every instruction set, so their bits are the same on all. Its rows are row-invariant by
construction either way. It runs
where the library has OpenMP (``linear_preferred``): on avx512_bf16 it beat
oneDNN's prepacked GEMM at every row count measured, and elsewhere torch's bf16 GEMM has no fast path at all (see
``Linear`` and docs/benchmarks.md). On avx512_bf16 a prefill's causal attention runs on its tiles too
(``causal``), and the step's bf16 attention runs the same arithmetic (``attention``), so a step row gets a
prefill row's bits; elsewhere the prefill runs the step's own attention (``attention.prefill_form``).

Where all of those run, in bf16, a step's or a verify pass's layers are one call (``Layers``), which
calls the same kernels in the same order with the same roundings: the per-op path's bits, without its
two dozen torch and ctypes calls a layer (the step profile is in docs/benchmarks.md).
"""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from knnssd.engine.model import native_library

log = logging.getLogger(__name__)

class RMSNorm:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32 and rounded once to x's
    dtype (``F.rms_norm``'s formula, for a weight of either dtype; its sum of squares runs in another
    order, so a value may differ from ``F.rms_norm``'s by an ulp), for CPU tensors in bf16 or fp32.
    ``of`` returns None where the kernels are not built or the weight is not on the CPU."""

    def __init__(self, lib: native_library.Kernels, weight: torch.Tensor, eps: float):
        self.weight = weight.detach().float().contiguous()  # the kernels read an fp32 weight
        self.n, self.eps, self.weight_ptr = self.weight.numel(), eps, self.weight.data_ptr()
        self.kernels = lib.rms_norm

    @classmethod
    def of(cls, weight: torch.Tensor, eps: float) -> "RMSNorm | None":
        lib = native_library.library() if weight.is_cpu else None
        return cls(lib, weight, eps) if lib is not None else None

    def __reduce__(self):  # copies and pickles load the library again (ctypes functions cannot be pickled)
        return RMSNorm.of, (self.weight, self.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The norm of x, or None for a dtype or device the kernels do not take."""
        kernel = self.kernels.get(x.dtype)
        if kernel is None or not x.is_cpu or x.shape[-1] != self.n:
            return None
        if not x.is_contiguous():  # e.g. a q-norm's heads, sliced from QKV rows: the same values, copied
            x = x.contiguous()
        out = torch.empty_like(x)
        kernel(x.data_ptr(), self.weight_ptr, out.data_ptr(), x.numel() // self.n, self.n, self.eps)
        return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """``layers.apply_rope`` in one call, rounding as its torch ops do: x (T, heads, D) with each head's D values
    contiguous and heads D apart (a slice of QKV rows; tokens any stride apart), cos and sin_signed
    contiguous (T, 1, d) of x's dtype, d even and <= D -> a new contiguous (T, heads, D); None for
    anything else (the caller runs the torch ops)."""
    if not x.is_cpu or x.dim() != 3 or cos.dtype != x.dtype or sin_signed.dtype != x.dtype:
        return None
    lib = native_library.library()
    kernel = None if lib is None else lib.rope.get(x.dtype)
    T, heads, D = x.shape
    d = cos.shape[-1]
    if (kernel is None or x.stride(2) != 1 or x.stride(1) != D or d % 2 or d > D or cos.shape != (T, 1, d)
            or sin_signed.shape != cos.shape or not (cos.is_contiguous() and sin_signed.is_contiguous())):
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr(), T, heads, D, d)
    return out


class Rows:
    """The query rows of an attention call (``attention``): each row's cache slot and position (int64
    CPU tensors, never read here: the kernel checks them) and the layer's sliding window (None: none).
    Built once per call and window and shared by its layers, it also keeps what its first
    ``attention`` call checked (the tensors' layout) and allocated (the kernel's scratch), for the
    layers after it."""

    def __init__(self, slots: torch.Tensor, pos: torch.Tensor, window: int | None):
        self.slots, self.pos = slots.contiguous(), pos.contiguous()
        self.window = window or 0
        self.threads = torch.get_num_threads()  # torch's: the kernel shares out its work on the same pool
        self.checked: tuple | None = None  # the layout the last call was checked for
        self.scratch: torch.Tensor | None = None


def _layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return q.dtype, q.device, q.shape, q.stride(), k.dtype, k.device, k.shape, k.stride(), v.dtype, v.shape, v.stride()


def _fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> bool:
    if not q.is_cpu or not k.is_cpu or q.dim() != 3 or k.dim() != 4:
        return False
    R, H, D = q.shape
    return (k.dtype == q.dtype and v.dtype == q.dtype and k.shape == v.shape and k.stride() == v.stride()
            and k.shape[3] == D and k.stride(3) == 1 and k.stride(2) == D and q.stride(2) == 1 and q.stride(1) == D
            and rows.pos.shape == (R,) and rows.slots.shape == (R,) and rows.pos.dtype == rows.slots.dtype == torch.long
            and rows.pos.is_cpu and rows.slots.is_cpu)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows, scale: float) -> torch.Tensor | None:
    """Attention of each query row alone (``native.c``'s ``attention``): q (R, H, D) with each head's D
    values contiguous and heads D apart (rows any stride apart), k and v (S, KV, L, D) cache buffers of
    q's dtype with one layout, D values per position; row r reads positions 0..rows.pos[r] (within the
    window) of slot rows.slots[r]. Returns (R, H * D); None where the kernels are not built, the
    tensors are laid out otherwise, or a row's slot or position lies outside the buffers.

    In bf16 where the library has avx512_bf16 and D % 32 == 0, each row is computed as ``causal``
    computes it (the same products in the same order, the probabilities rounded to bf16), reading
    the cache in place. It is faster than the SIMD form where the cache is in cache, and no slower
    where reading the keys and values from memory bounds both (docs/benchmarks.md). Elsewhere the
    SIMD form (AVX-512F, AVX2 with FMA, NEON), else the portable loop."""
    lib = native_library.library()
    kernel = None if lib is None else lib.attention.get(q.dtype)
    if kernel is None:
        return None
    layout = _layout(q, k, v)
    if layout != rows.checked:  # the first layer of a call, or another layout
        if not _fits(q, k, v, rows):
            return None
        rows.checked = layout
        per = lib.attention_scratch(max(1, q.shape[1] // k.shape[1]), q.shape[2], k.shape[2])
        rows.scratch = torch.empty(rows.threads, per, dtype=torch.float32)
    R, H, D = q.shape
    S, KV, L, _ = k.shape
    out = torch.empty(R, H * D, dtype=q.dtype)
    if kernel(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), S, k.stride(0), L, k.stride(1),
              rows.slots.data_ptr(), rows.pos.data_ptr(), out.data_ptr(), R, H, KV, D, rows.window, scale,
              rows.scratch.data_ptr(), rows.scratch.shape[1], rows.threads):
        return None
    return out


class Linear:
    """``x W^T + b`` by ``native.c``'s ``linear``: bf16 rows, W (N, K) prepacked once into its layout (a second
    copy, as oneDNN's prepacking makes), the bias kept in fp32, on AMX's tiles where the CPU has them (and K % 32),
    on ``vdpbf16ps`` where it has avx512_bf16, else widened to fp32 in registers (AVX-512F, AVX2 with FMA, NEON).
    Each output is summed in one fixed order and rounded once, so a row's outputs do not depend on the call's rows. ``int8``: the same over a
    weight-only int8 copy (a draft's, ``weights.Int8Linear``), scaled per output.

    It was faster than oneDNN's prepacked GEMM at every row count a step or a batch packs on avx512_bf16, and
    than torch's bf16 GEMM by far on AVX2 (docs/benchmarks.md). ``of`` and ``int8`` return None where it does
    not apply: no library, another dtype or device, N not a multiple of 16 or K odd, a library without a
    vector instruction set, or a library without OpenMP (``linear_preferred``)."""

    KINDS = {"bf16": 0, "int8": 1, "q4": 2, "q8": 3}  # the weights' forms, as ``native.c``'s fused layers name them

    def __init__(self, kernel: Callable, packed: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 kind: str = "bf16"):
        self.kernel, self.packed, self.scale, self.kind = kernel, packed, scale, kind
        per_pair = 32 if kind in ("q4", "q8") else 2  # inputs per packed index of dim 1
        self.n, self.k = packed.shape[0] * 16, packed.shape[1] * per_pair
        self.bias = None if bias is None else bias.detach().float().contiguous()
        pointers = (packed.data_ptr(),) if scale is None else (packed.data_ptr(), scale.data_ptr())
        self.weights = (*pointers, 0 if self.bias is None else self.bias.data_ptr())  # the kernel's arguments

    @staticmethod
    def _kernel(family: str, weight: torch.Tensor, dtype: torch.dtype) -> Callable | None:
        if (not weight.is_cpu or weight.dtype != dtype or weight.dim() != 2 or weight.shape[0] % 16
                or weight.shape[1] % 2):
            return None
        return native_library.tiled(family)

    @staticmethod
    def _pack(weight: torch.Tensor) -> torch.Tensor:
        N, K = weight.shape
        return weight.detach().reshape(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()

    def dense(self) -> torch.Tensor:
        """The weights (N, K) unpacked (a copy; blocks as d q (+ m) in fp32, then bf16)."""
        if self.kind in ("q4", "q8"):
            q, d, *m = self.q4_parts() if self.kind == "q4" else self.q8_parts()
            w = q.float().view(self.n, -1, 32) * d.float()[..., None]
            w = w + m[0].float()[..., None] if m else w
            return w.reshape(self.n, self.k).to(torch.bfloat16)
        return self.packed.permute(0, 2, 1, 3).reshape(self.n, self.k)

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Linear | None":
        kernel = cls._kernel("linear", weight, torch.bfloat16)
        return None if kernel is None else cls(kernel, cls._pack(weight), None, bias)

    @classmethod
    def int8(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> "Linear | None":
        kernel = cls._kernel("linear_int8", q, torch.int8)
        if kernel is None:
            return None
        return cls(kernel, cls._pack(q), scales.detach().float().contiguous(), bias, "int8")

    @classmethod
    def q4(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None) -> "Linear | None":
        """4-bit weights in blocks of 32 inputs, w = d q + m (GGUF's Q4_1; Q4_0 is m = -8 d): q (N, K) uint8 in
        0..15, d and m (N, K / 32) fp16. None where the kernel does not apply (as ``of``, or K % 32)."""
        N, K = q.shape
        kernel = native_library.tiled("linear_q4")
        if kernel is None or N % 16 or K % 32 or d.shape != (N, K // 32) or m.shape != d.shape:
            return None
        # 4 inputs of a column a 32-bit lane, for ``native.c``'s integer sums (``qcols``)
        g = q.to(torch.uint8).reshape(N // 16, 16, K // 32, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # NB, KB, group, col, ...
        lo, hi = g[..., 0, :], g[..., 1, :]  # byte i of group g: inputs 8 g + i, 8 g + 4 + i
        nibbles = (lo | (hi << 4)).contiguous()
        dm = torch.stack([t.to(torch.float16).reshape(N // 16, 16, K // 32).transpose(1, 2) for t in (d, m)], 2)
        return cls(kernel, nibbles, dm.contiguous().view(torch.int16), bias, "q4")

    def q4_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, d, m) as ``q4`` takes them, unpacked (copies)."""
        NB, KB = self.packed.shape[:2]
        lo, hi = self.packed & 15, self.packed >> 4
        q = torch.stack((lo, hi), 4).permute(0, 3, 1, 2, 4, 5).reshape(self.n, self.k)  # (NB, col, KB, group, ...)
        dm = self.scale.view(torch.float16)  # (NB, KB, 2, 16)
        d, m = (dm[:, :, j].transpose(1, 2).reshape(self.n, KB) for j in (0, 1))
        return q, d, m

    @classmethod
    def q8(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None) -> "Linear | None":
        """8-bit weights in blocks of 32 inputs, w = d q (GGUF's Q8_0): q (N, K) int8, d (N, K / 32) fp16. Packed
        as ``q4`` packs, a byte a weight. None where the kernel does not apply (as ``q4``)."""
        N, K = q.shape
        kernel = native_library.tiled("linear_q8")
        if kernel is None or N % 16 or K % 32 or d.shape != (N, K // 32):
            return None
        g = q.to(torch.int8).reshape(N // 16, 16, K // 32, 8, 4).permute(0, 2, 3, 1, 4)  # (NB, KB, group, col, input)
        ds = d.to(torch.float16).reshape(N // 16, 16, K // 32).transpose(1, 2)  # (NB, KB, 16)
        return cls(kernel, g.reshape(N // 16, K // 32, 16, 32).contiguous(), ds.contiguous().view(torch.int16), bias,
                   "q8")

    def q8_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, d) as ``q8`` takes them, unpacked (copies)."""
        NB, KB = self.packed.shape[:2]
        q = self.packed.view(NB, KB, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(self.n, self.k)
        return q, self.scale.view(torch.float16).transpose(1, 2).reshape(self.n, KB)

    def __reduce__(self):  # as ``RMSNorm``'s: the library is loaded again
        if self.kind == "q4":
            return Linear.q4, (*self.q4_parts(), self.bias)
        if self.kind == "q8":
            return Linear.q8, (*self.q8_parts(), self.bias)
        if self.scale is None:
            return Linear.of, (self.dense(), self.bias)
        return Linear.int8, (self.dense(), self.scale, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (..., K) bf16 -> (..., N) bf16; None for another dtype, device or width."""
        if x.dtype != torch.bfloat16 or not x.is_cpu or x.shape[-1] != self.k:
            return None
        rows = x.reshape(-1, self.k)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        M = rows.shape[0]
        out = torch.empty(*x.shape[:-1], self.n, dtype=torch.bfloat16)
        if M and self.kernel(rows.data_ptr(), rows.stride(0), *self.weights, out.data_ptr(), M, self.k, self.n,
                             torch.get_num_threads()):
            return None
        return out


def causal_runs(dtype: torch.dtype, device: torch.device | str, head_dim: int) -> bool:
    """Does ``causal`` take prefills of this dtype, device and head size (laid out as a cache is)? bf16 on
    the CPU, D % 16 == 0, where ``Linear`` is used (``tiled``)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and head_dim % 16 == 0
            and native_library.tiled("causal") is not None)


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int) -> torch.Tensor | None:
    """Causal attention of a prefill (``native.c``'s ``causal``): q (T, H, D) bf16 at positions start..start+T-1
    (each head's D values contiguous, heads D apart, rows any stride apart), k and v (1, KV, L, D) of one
    layout with L >= start + T; query t reads keys 0..start+t. Returns (1, T, H * D), each row computed
    alone from its query and keys (the same bits whatever T and start). None where ``Linear`` would not
    be used (``linear_preferred``: the same tiles), for other dtypes, devices or layouts, or D % 16.

    It is faster than ``attention.causal_blocks`` and SDPA at every prompt length measured, and no
    further from an fp32 run (docs/benchmarks.md)."""
    if q.dim() != 3 or k.dim() != 4 or not causal_runs(q.dtype, q.device, q.shape[2]):
        return None
    T, H, D = q.shape
    _, KV, L, _ = k.shape
    if (k.dtype != q.dtype or v.dtype != q.dtype or not k.is_cpu or k.shape != v.shape or k.stride() != v.stride()
            or k.shape[0] != 1 or k.shape[3] != D or k.stride(3) != 1 or k.stride(2) != D or q.stride(2) != 1
            or q.stride(1) != D or L < start + T or H % KV):
        return None
    out = torch.empty(1, T, H * D, dtype=q.dtype)
    kernel = native_library.tiled("causal")
    if kernel(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(1), start, T, H, KV, D, scale,
              out.data_ptr(), torch.get_num_threads()):
        return None
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of a gated MLP's fused projection gu (..., 2 I) -> (..., I) in one call, rounded as
    the two torch ops round (``native.c``'s ``silu_mul``, also the fused layers' own); None where the kernels
    are not built, or for another dtype or device."""
    lib = native_library.library() if gu.is_cpu else None
    kernel = None if lib is None else lib.silu_mul.get(gu.dtype)
    if kernel is None or gu.shape[-1] % 2:
        return None
    if not gu.is_contiguous():
        gu = gu.contiguous()
    I = gu.shape[-1] // 2
    out = torch.empty(*gu.shape[:-1], I, dtype=gu.dtype)
    kernel(gu.data_ptr(), out.data_ptr(), gu.numel() // (2 * I), I)
    return out


class _Layer(ctypes.Structure):  # ``native.c``'s ``fused_layer``
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("attn_eps", ctypes.c_double),
                ("mlp_eps", ctypes.c_double), ("w", ctypes.c_void_p * 4), ("scale", ctypes.c_void_p * 4),
                ("bias", ctypes.c_void_p * 4), ("window", ctypes.c_int64), ("kind", ctypes.c_int64 * 4)]


@dataclass(frozen=True)
class LayerParts:
    """What ``Layers`` runs of one decoder layer: its two norms and four projections (qkv, o, gate_up,
    down: ``Linear`` kernels, bf16 or int8) and its sliding window (None: none)."""

    attn_norm: RMSNorm
    mlp_norm: RMSNorm
    linears: tuple[Linear, Linear, Linear, Linear]
    window: int | None


class Layers:
    """A decoder's layers in one C call per pass (``native.c``'s ``layers_bf16``): for each layer, norm, QKV,
    RoPE, the cache write, attention, output projection, residual, norm, gate/up, SiLU product, down and
    residual, each by the same kernel and rounding as the per-op path (``decoder.Decoder``'s, with ``Linear``,
    ``RMSNorm``, ``rope``, ``attention`` and ``silu_mul``), so a row's bits do not change with the path, and
    each row is computed alone as there. A skip mask leaves sub-layers out inside the call.

    What a step spends between kernels (about 30 torch and ctypes calls a layer) is one call here: see the
    step profile in docs/benchmarks.md. ``of`` returns None where it does not apply (``Linear`` is not used
    here)."""

    def __init__(self, kernel: Callable, parts: list[LayerParts], heads: int, kv: int, head_dim: int):
        self.kernel, self.parts = kernel, parts  # parts keep the weights the structs point to alive
        self.n, self.H, self.KV, self.D = len(parts), heads, kv, head_dim
        self.E, self.I = parts[0].linears[0].k, parts[0].linears[3].k
        self.structs = (_Layer * self.n)()
        for s, p in zip(self.structs, parts):
            s.attn_norm, s.mlp_norm = p.attn_norm.weight_ptr, p.mlp_norm.weight_ptr
            s.attn_eps, s.mlp_eps = p.attn_norm.eps, p.mlp_norm.eps
            for j, lin in enumerate(p.linears):
                s.w[j] = lin.packed.data_ptr()
                s.scale[j] = 0 if lin.scale is None else lin.scale.data_ptr()
                s.bias[j] = 0 if lin.bias is None else lin.bias.data_ptr()
                s.kind[j] = Linear.KINDS[lin.kind]
            s.window = p.window or 0
        self._skips: dict[tuple, ctypes.Array | None] = {}
        self._buffers: tuple | None = None  # (key, k pointers, v pointers) of the last cache
        # whether a call takes a ``TreeMap``
        self.trees = bool(native_library.library().tree_keys(heads, kv, head_dim))

    @classmethod
    def of(cls, parts: list[LayerParts], heads: int, kv: int, head_dim: int) -> "Layers | None":
        lib = native_library.library()
        nothing = (0,) * len(native_library.LAYERS)  # a call with nothing to do: 0 where the library runs layers
        if lib is None or native_library.tiled("linear") is None or not parts or lib.layers(*nothing) != 0:
            return None
        return cls(lib.layers, parts, heads, kv, head_dim)

    def _skip(self, skip: tuple[tuple[bool, ...], tuple[bool, ...]] | None):
        if skip not in self._skips:
            self._skips[skip] = None if skip is None else (ctypes.c_uint8 * (2 * self.n))(*skip[0], *skip[1])
        return self._skips[skip]

    def _pointers(self, k: list[torch.Tensor], v: list[torch.Tensor]) -> tuple:
        """The C arrays of every layer's K and V buffers, built again when any buffer moved: a cache allocated
        after another was freed can take its first and last layers' memory and not the rest, so a key of the
        ends alone once had a batch read a freed cache's middle layers."""
        key = tuple(t.data_ptr() for t in k) + tuple(t.data_ptr() for t in v)
        if self._buffers is None or self._buffers[0] != key:
            n = len(k)
            self._buffers = (key, (ctypes.c_void_p * n)(*key[:n]), (ctypes.c_void_p * (len(key) - n))(*key[n:]))
        return self._buffers[1:]

    def __call__(self, h: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor],
                 skip: tuple[tuple[bool, ...], tuple[bool, ...]] | None, scale: float,
                 tree: "TreeMap | None" = None) -> bool:
        """Run rows h (R, E) bf16, contiguous, updated in place, at cache slots ``slots`` and positions ``pos``
        (R,) int64; cos, sin (P, 1, d) the rotary tables by position; k[i], v[i] (S, KV, L, D) layer i's cache
        buffers, one layout; ``skip``: a mask's (attention, MLP) bits; ``tree``: where a token tree's rows
        write and read their K/V. False (h untouched) where the call does not take these tensors."""
        S, KV, L, D = k[0].shape
        R = h.shape[0]
        if (h.dtype != torch.bfloat16 or not h.is_contiguous() or h.shape[1] != self.E or KV != self.KV
                or D != self.D or k[0].dtype != torch.bfloat16 or k[0].stride(3) != 1 or k[0].stride(2) != D
                or len(k) != self.n or cos.dtype != torch.bfloat16 or not cos.is_contiguous()
                or not sin.is_contiguous() or cos.shape[0] < L):
            return False
        threads = torch.get_num_threads()
        per = native_library.library().attention_scratch(self.H // KV, D, L)
        scratch = torch.empty(threads * per, dtype=torch.float32)  # per call: passes may run in several threads
        work = torch.empty(R * (2 * self.E + 3 * self.I + 3 * (self.H + KV) * D), dtype=torch.bfloat16)
        kp, vp = self._pointers(k, v)
        mapped = (0, 0, 0, 0) if tree is None else (
            tree.wpos.data_ptr(), tree.kstart.data_ptr(), tree.kmap.data_ptr(), tree.kmap.shape[1])
        return self.kernel(self.structs, self.n, self._skip(skip), h.data_ptr(), R, self.E, self.H, KV, D, self.I,
                           cos.data_ptr(), sin.data_ptr(), cos.shape[-1], kp, vp, S, k[0].stride(0), L,
                           k[0].stride(1), slots.data_ptr(), pos.data_ptr(), scale, work.data_ptr(),
                           scratch.data_ptr(), per, threads, *mapped) == 0


class TreeMap(NamedTuple):
    """Where a token tree's rows write and read their K/V in a ``Layers`` call (``native.c``'s
    ``key_map_fits``): row r writes at place wpos[r] of its slot, and reads the key of each position
    p >= kstart[r] at place kmap[r, p - kstart[r]] (its path's places), the keys below where they are.
    wpos, kstart (R,) and kmap (R, W), W <= 16, int64, contiguous."""

    wpos: torch.Tensor
    kstart: torch.Tensor
    kmap: torch.Tensor
