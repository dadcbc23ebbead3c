"""A GGUF file's own blocks as a decoder's weights (``--dtype gguf``).

transformers reads a GGUF by de-quantizing every tensor to the torch dtype: SmolLM2's Q4_1 file
(92 MiB) becomes 269 MB of bf16, and each token then reads 2.9x the bytes the file holds. Here the
projections and the head whose tensors are Q4_0 or Q4_1 run on ``native.Linear.q4`` over the file's
blocks as they are (w = d q + m per 32 inputs; Q4_0's m is -8 d), and those that are Q8_0 (w = d q) on
``native.Linear.q8``, with bf16 activations quantized per block of 32 to 8 bits, as llama.cpp does for
these blocks, the block sums exact in integers and the rest in fp32 (docs/exactness.md). A head tied to
the embeddings runs on the embeddings' tensor (SmolLM2's is Q8_0: 30 MB a token instead of 57).
Every other tensor (norms, the embedding lookup, a projection of another type) keeps the de-quantized
weights transformers loaded.

``--dtype q4_1`` and ``q8_0`` make such blocks from any model's weights at load (``quantize_stack``), as
llama.cpp's reference quantizers do: the projections in that format, the head in Q8_0 (llama.cpp keeps
the output tensor at 6 bits or more too).

The precision is its own: plain decoding over these weights is the reference that speculative
decoding equals, and the exactness probe measures it as it measures bf16. A de-quantized block is the
value transformers computes (``gguf``'s d * q + m in fp32, then rounded to bf16), so a projection's
weights are the bf16 model's within that last rounding, and the tests check it.

Terms: N outputs, K inputs, KB = K / 32 blocks per output.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import torch

from knnssd.engine.model import native
from knnssd.engine.model.weights import PROJECTIONS, NativeLinear, Stack

BLOCK = 32
# GGUF tensor names of a layer's projections, in the order ``weights.Layer``'s fused ones concatenate them
SOURCES = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
           "down": ("ffn_down",)}


class QuantizedWeightsError(ValueError):
    """The GGUF file cannot give this model its 4-bit weights (one line, for the user)."""


TYPES = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8"}  # GGUF block types -> ``native.Linear``'s kinds


def blocks(tensor) -> tuple[np.ndarray, ...] | None:
    """A ``gguf.ReaderTensor``'s blocks as ``native.Linear.q4`` (Q4_0, Q4_1: q (N, K) uint8 in 0..15, d, m (N, KB)
    float16) or ``native.Linear.q8`` (Q8_0: q (N, K) int8, d) takes them; None for another type."""
    kind = tensor.tensor_type.name
    if kind not in TYPES:
        return None
    K = int(tensor.shape[0])  # GGUF lists dims fastest first
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, K // BLOCK, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind])
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        return raw[..., 2:].copy().view(np.int8).reshape(raw.shape[0], K), d
    if kind == "Q4_0":
        m, qs = (-8 * d.astype(np.float32)).astype(np.float16), raw[..., 2:]  # 8 d is exact in fp16 below overflow
    else:
        m, qs = raw[..., 2:4].copy().view(np.float16)[..., 0], raw[..., 4:]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).reshape(raw.shape[0], K)  # byte j: inputs j and j + 16
    return q, d, m


def reader(path: Path):
    """The GGUF file's ``gguf.GGUFReader`` (its header parsed, the file mapped read-only). ``--dtype gguf`` reads
    the file to check that it holds blocks (``holds_blocks``) before the model loads, then for the blocks
    (``gguf_stack``), and parsing a tokenizer's metadata field by field is slow (docs/benchmarks.md): the second
    call takes the first's reader. The last two files' readers are kept for the process."""
    st = Path(path).stat()
    return _reader(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=2)
def _reader(path: str, *stat: int):  # device, inode, size and times: a file replaced or rewritten is read again
    import gguf

    return gguf.GGUFReader(path)


def holds_blocks(path: Path) -> bool:
    """Does the GGUF file hold a Q4_0 or Q4_1 tensor (read from its header: the file is mapped, not loaded)?"""
    return any(t.tensor_type.name in ("Q4_0", "Q4_1") for t in reader(path).tensors)


def _unpermute(a: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the rotary halves of each q and k head; transformers undoes it on
    the rows (``LlamaTensorProcessor``), so the blocks' rows are put back the same way."""
    dim = a.shape[0] // heads // 2
    return a.reshape(heads, dim, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _native(tensors: list, arrays: list[tuple[np.ndarray, ...]], linear, where: str) -> NativeLinear | None:
    """``linear`` on the blocks of ``tensors`` (concatenated by rows, as the fused projection concatenates
    them; ``arrays`` their blocks), or None where they are not all of one kind of blocks."""
    kinds = {TYPES.get(t.tensor_type.name) for t in tensors}
    if len(kinds) != 1 or None in kinds:
        return None  # another type (or a mix): the de-quantized weights stay
    parts = [torch.from_numpy(np.concatenate([a[j] for a in arrays])) for j in range(len(arrays[0]))]
    if tuple(parts[0].shape) != tuple(linear.weight.shape):
        raise QuantizedWeightsError(f"{where} holds {tuple(parts[0].shape)} weights, the model "
                                    f"{tuple(linear.weight.shape)}")
    return _on_blocks(kinds.pop(), parts, linear)


def _on_blocks(kind: str, parts, linear) -> NativeLinear:
    """``linear`` run by ``native.Linear``'s ``kind`` ("q4" or "q8") kernel over ``parts`` (as that kernel takes
    them); the dense weight stays for shapes and int8 drafts."""
    kernel = getattr(native.Linear, kind)(*parts, linear.bias)
    if kernel is None:
        raise QuantizedWeightsError("block weights run on the native kernels, which need a C compiler and a CPU "
                                    "with AVX2 and FMA, AVX-512 or ARM64 NEON")
    return NativeLinear(linear.weight, linear.bias, kernel)


def gguf_stack(stack: Stack, path: Path) -> tuple[Stack, int]:
    """A copy of ``stack`` whose projections and head run on the blocks of the GGUF file ``path`` (the file the
    model was loaded from), and how many of them do. Raises ``QuantizedWeightsError`` where the file has
    none, or the native kernel does not run here (``native_library.tiled``)."""
    header = reader(path)
    tensors = {t.name: t for t in header.tensors}
    field = header.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    unpermute = {"attn_q": stack.n_heads, "attn_k": stack.n_kv} if architecture == "llama" else {}
    layers, count = [], 0
    for i, layer in enumerate(stack.layers):
        changes = {}
        for name in PROJECTIONS:
            sources = [tensors.get(f"blk.{i}.{src}.weight") for src in SOURCES[name]]
            found = [None if t is None else blocks(t) for t in sources]  # each tensor read once
            if any(b is None for b in found):
                continue  # another type (or a name this map does not know): the de-quantized weights stay
            arrays = [tuple(_unpermute(a, unpermute[src]) if src in unpermute else a for a in b)
                      for src, b in zip(SOURCES[name], found)]
            linear = _native(sources, arrays, getattr(layer, name), f"{path.name}: blk.{i} {name}")
            if linear is not None:
                changes[name] = linear
                count += 1
        layers.append(dataclasses.replace(layer, **changes))
    head = tensors.get("output.weight", tensors.get("token_embd.weight"))  # no output.weight: tied to the embeddings
    lm_head = stack.lm_head
    head_blocks = None if head is None else blocks(head)
    if head_blocks is not None:
        lm_head = _native([head], [head_blocks], stack.lm_head, f"{path.name}: {head.name}") or lm_head
        count += lm_head is not stack.lm_head
    if not count:
        raise QuantizedWeightsError(f"{path.name} holds no Q4_0, Q4_1 or Q8_0 projections")
    return dataclasses.replace(stack, layers=layers, lm_head=lm_head), count


def quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, ...]:
    """w (N, K) in blocks of 32 inputs as llama.cpp's ``quantize_row_q4_1_ref`` / ``quantize_row_q8_0_ref`` make
    them, in the form ``native.Linear.q4`` / ``q8`` take: Q4_1 d = (max - min) / 15, m = min, q = the nearest
    step from min (0..15); Q8_0 d = max |w| / 127, q = w / d rounded half away from zero. The steps use the
    fp32 d, the file keeps it in fp16, as llama.cpp's do."""
    N, K = w.shape
    x = w.float().reshape(N, K // BLOCK, BLOCK)
    if kind == "q8_0":
        d = x.abs().amax(-1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        scaled = x * inv[..., None]
        q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-128, 127).to(torch.int8)
        return q.reshape(N, K), d.half()
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = ((x - lo[..., None]) * inv[..., None] + 0.5).floor().clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), d.half(), lo.half()


def quantize_stack(stack: Stack, kind: str) -> tuple[Stack, int]:
    """A copy of ``stack`` whose projections run on ``kind`` (``q4_1`` or ``q8_0``) blocks made from its weights,
    and its head on Q8_0 ones, and how many do (a projection whose inputs are not a multiple of 32 keeps its
    weights). Raises ``QuantizedWeightsError`` where the native kernels do not run here."""
    def blocked(linear, form: str):
        w = linear.weight
        if w.shape[1] % BLOCK or w.shape[0] % 16:
            return None
        return _on_blocks("q8" if form == "q8_0" else "q4", quantize(w, form), linear)

    layers, count = [], 0
    for layer in stack.layers:
        changes = {name: blocked(getattr(layer, name), kind) for name in PROJECTIONS}
        changes = {name: lin for name, lin in changes.items() if lin is not None}
        count += len(changes)
        layers.append(dataclasses.replace(layer, **changes))
    head = blocked(stack.lm_head, "q8_0")
    count += head is not None
    return dataclasses.replace(stack, layers=layers, lm_head=head or stack.lm_head), count
