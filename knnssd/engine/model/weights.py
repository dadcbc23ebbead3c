"""A decoder's weights gathered into plain tensors, for a lean forward pass.

HF modules cost Python dispatch per layer per call; the forward in ``decoder.py`` runs the
same math from these tensors with a handful of torch calls per sub-layer (fused QKV and
gate/up projections, a static KV cache). ``from_hf`` reads the standard decoder layout shared
by Llama, Mistral, Qwen2/3, Gemma3, Phi3 and their relatives; anything else raises
``UnsupportedArchitecture`` and the caller falls back to plain HF forwards. ``decoder.Decoder``
checks the result against the HF model once on load.

Terms: H query heads, KV key/value heads, D head dim, T tokens in a call, V vocabulary.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from knnssd.engine.model import native


class UnsupportedArchitecture(ValueError):
    """The model's layers do not follow a layout the lean forward knows."""


PACK_MIN_NUMEL = 1 << 18


@dataclass
class Linear:
    """y = x W^T + b."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def packed(self, force: bool = False) -> "Linear | PackedLinear | NativeLinear":
        """The native kernel's form where it applies (``native.Linear``: bf16 on a CPU with a vector instruction set),
        else a oneDNN-prepacked copy on CPU for large weights (MKL's small-batch GEMMs were slower:
        docs/benchmarks.md), else self (small ones: the packed call's fixed overhead wins,
        unless ``force``: MKL's fp32 rows depend on the row count, oneDNN's did not)."""
        if self.weight.device.type != "cpu":
            return self
        own = native.Linear.of(self.weight, self.bias)
        if own is not None:
            return NativeLinear(self.weight, self.bias, own)
        if self.weight.numel() < PACK_MIN_NUMEL and not force:
            return self
        try:
            return PackedLinear(torch.ops.mkldnn._reorder_linear_weight(self.weight, 16), self.bias)
        except (RuntimeError, AttributeError):  # e.g. bf16 on a CPU without avx512/avx_ne_convert
            return self

    def int8(self) -> "Int8Linear":
        return Int8Linear.from_weight(self.weight, self.bias)


class PackedLinear:
    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None):
        self.packed_weight, self.bias = packed, bias
        self.weight = packed  # oneDNN's packed tensor keeps the logical (out, in) shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def packed(self, force: bool = False) -> "PackedLinear":
        return self

    def int8(self) -> "Int8Linear":
        return Int8Linear.from_weight(self.packed_weight.to_dense(), self.bias)


class NativeLinear:
    """A Linear run by ``native.Linear`` (its packed copy); the dense weight is kept for shapes and ``int8``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: native.Linear):
        self.weight, self.bias, self.kernel = weight, bias, kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = None if self.kernel is None else self.kernel(x)  # kernel None: unpickled where it does not apply
        return F.linear(x, self.weight, self.bias) if y is None else y  # y None: another dtype (never in a step)

    def packed(self, force: bool = False) -> "NativeLinear":
        return self

    def int8(self) -> "Int8Linear | NativeLinear":
        """A draft's weight-only int8 copy; on blocks of 4 or 8 bits (``--dtype gguf``, ``q4_1``, ``q8_0``) the blocks
        themselves: an int8 copy would read as many bytes as a step or more (SmolLM2's Q4_1 file: 135 MB a draft token
        against 92 MB a full one)."""
        if self.kernel is not None and self.kernel.kind in ("q4", "q8"):
            return self
        return Int8Linear.from_weight(self.weight, self.bias)


class Int8Linear:
    """Weight-only int8 copy of a Linear (symmetric, per output channel), for drafts only.

    ``_weight_int8pack_mm`` with bf16 activations (CPU and CUDA), or, where the native linear kernel
    applies (``native.Linear.int8``), that kernel, which reads the int8 weights directly: there
    ``_weight_int8pack_mm`` was slower than the native bf16 kernel, so an int8 draft step would cost
    more than the full step it stands in for. Drafts need not be exact: the full model verifies every
    token. fbgemm's dynamic int8, which also quantizes activations, was faster but agreed with the
    full model far less often (docs/benchmarks.md).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        self.scales, self.bias = scales, bias
        self.kernel = native.Linear.int8(q, scales, bias)
        self._q = q if self.kernel is None else None  # the kernel keeps its own packed copy

    @property
    def q(self) -> torch.Tensor:
        """The int8 weights (N, K)."""
        return self._q if self.kernel is None else self.kernel.dense()

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales.to(torch.bfloat16), None if bias is None else bias.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(x.to(torch.bfloat16))
            if y is not None:
                return y.to(x.dtype)
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.q, self.scales)
        y = y.to(x.dtype).reshape(*shape[:-1], y.shape[-1])
        return y if self.bias is None else y + self.bias


class RowPadded:
    """Runs a one-row call as two rows (the row twice) and keeps the first.

    Some GEMM libraries take another kernel for a single row, which rounds differently: oneDNN
    did for fp32 and bf16 with 1152+ inputs on the dev machine. From two rows up the rows of a
    call were bitwise independent of how many there were; ``exactness.py`` wraps only the
    linears that need it.
    """

    def __init__(self, inner: "Linear | PackedLinear"):
        self.inner = inner
        self.weight = inner.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] != 1:
            return self.inner(x)
        return self.inner(torch.cat((x, x), dim=-2)).narrow(-2, 0, 1)

    def int8(self) -> "Int8Linear":
        return self.inner.int8()

    def packed(self, force: bool = False) -> "RowPadded":
        return self


@dataclass
class Norm:
    """RMSNorm. ``offset`` (Gemma): ``x_hat * (1 + w)`` computed in fp32, then cast;
    otherwise (Llama): ``w * x_hat``. ``weight`` already holds ``1 + w`` for offset norms.
    Both are one C call on the CPU where ``native`` is built (``F.rms_norm``'s formula, within an ulp
    of it, in about a fifth of its time for one row), else torch ops."""

    weight: torch.Tensor
    eps: float
    offset: bool
    kernel: native.RMSNorm | None = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.kernel = native.RMSNorm.of(self.weight, self.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x) if self.kernel is not None else None
        if y is not None:
            return y
        if self.offset:
            return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).type_as(x)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a layer's linears (``Layer``), in the order they run


@dataclass
class Layer:
    attn_norm: Norm
    qkv: Linear  # fused q, k, v projections: (H + 2 KV) * D outputs
    o: Linear
    mlp_norm: Norm
    gate_up: Linear  # fused gate and up projections: 2 * I outputs
    down: Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    rope: str  # key into Stack.rope_keys (Gemma3 has one rope per layer type)
    window: int | None  # sliding window length, None = full attention
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    attn_post_norm: Norm | None = None  # Gemma: norm on the attention output before the residual add
    mlp_post_norm: Norm | None = None
    silu: bool = False  # act is SiLU: the MLP's activation and product run as one native call where built


@dataclass
class Stack:
    embed: torch.Tensor
    embed_scale: torch.Tensor | None
    layers: list[Layer]
    norm: Norm
    lm_head: Linear
    n_heads: int
    n_kv: int
    head_dim: int
    scale: float  # attention softmax scale
    rotary: Callable  # the HF rotary module: (x, position_ids[, layer_type]) -> (cos, sin)
    rope_keys: tuple[str, ...]
    rope_static: bool  # cos/sin depend on position only (not on sequence length): tables may be cached
    final_softcap: float | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def projections(self) -> list[Linear]:
        """Every layer's linears, layer by layer in ``PROJECTIONS`` order (the head is ``lm_head``)."""
        return [getattr(layer, name) for layer in self.layers for name in PROJECTIONS]

    def map_linears(self, fn) -> "Stack":
        """A copy with ``fn`` applied to every projection and the head (other tensors shared)."""
        layers = [dataclasses.replace(layer, **{name: fn(getattr(layer, name)) for name in PROJECTIONS})
                  for layer in self.layers]
        return dataclasses.replace(self, layers=layers, lm_head=fn(self.lm_head))

    def packed(self) -> "Stack":
        """Same weights, prepacked for this CPU's fastest GEMM (a second copy in memory)."""
        return self.map_linears(lambda lin: lin.packed())

    def int8(self) -> "Stack":
        """A copy whose projections and head are int8 (or keep their blocks of 4 or 8 bits: ``NativeLinear.int8``);
        norms, rope and embeddings are shared."""
        return self.map_linears(lambda lin: lin.int8())


def native_layers(s: Stack) -> "native.Layers | None":
    """The stack's layers as one native call a pass (``native.Layers``), where it runs every layer: bf16 on
    the CPU, each projection on ``native.Linear`` (bf16 or int8) and each norm on the native kernel, a SiLU
    MLP, no per-head or post norms, and one rotary table set by position alone."""
    if s.dtype != torch.bfloat16 or s.device.type != "cpu" or len(s.rope_keys) != 1 or not s.rope_static:
        return None
    parts = []
    for layer in s.layers:
        if (layer.q_norm is not None or layer.attn_post_norm is not None or layer.mlp_post_norm is not None
                or not layer.silu):
            return None
        norms = (layer.attn_norm.kernel, layer.mlp_norm.kernel)
        kernels = tuple(getattr(getattr(layer, name), "kernel", None) for name in PROJECTIONS)
        if None in norms or not all(isinstance(k, native.Linear) for k in kernels):
            return None
        parts.append(native.LayerParts(*norms, kernels, layer.window))
    return native.Layers.of(parts, s.n_heads, s.n_kv, s.head_dim)


def _norm(module: torch.nn.Module) -> Norm:
    weight = module.weight.detach()
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None:
        raise UnsupportedArchitecture(f"norm {type(module).__name__} has no eps")
    # Gemma-style norms store w with the output scaled by (1 + w); detect by the module's own output.
    probe = torch.randn(2, weight.shape[0], dtype=weight.dtype, device=weight.device)
    offset = Norm(1.0 + weight.float(), float(eps), True)
    plain = Norm(weight, float(eps), False)
    with torch.no_grad():
        want = module(probe)
    for cand in (plain, offset):
        if torch.allclose(cand(probe).float(), want.float(), rtol=1e-2, atol=1e-3):
            return cand
    raise UnsupportedArchitecture(f"norm {type(module).__name__} is not an RMSNorm this forward knows")


def _cat_linear(*mods: torch.nn.Linear) -> Linear:
    """One Linear from several with the same input; the HF modules' weights become views of the
    fused tensor (same values, no second copy in memory)."""
    if len(mods) == 1:
        bias = mods[0].bias
        return Linear(mods[0].weight.detach(), None if bias is None else bias.detach())
    weight = torch.cat([m.weight.detach() for m in mods], 0)
    row = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        row += n
    if all(m.bias is None for m in mods):
        return Linear(weight)
    bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.weight.shape[0]) for m in mods])
    return Linear(weight, bias)


def _layer(layer: torch.nn.Module, rope_key: str, default_window: int | None) -> Layer:
    attn, mlp = layer.self_attn, layer.mlp
    if hasattr(attn, "qkv_proj"):
        qkv = _cat_linear(attn.qkv_proj)
    elif all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj")):
        qkv = _cat_linear(attn.q_proj, attn.k_proj, attn.v_proj)
    else:
        raise UnsupportedArchitecture(f"attention {type(attn).__name__} has no q/k/v projections")
    if hasattr(mlp, "gate_up_proj"):
        gate_up = _cat_linear(mlp.gate_up_proj)
    elif hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"):
        gate_up = _cat_linear(mlp.gate_proj, mlp.up_proj)
    else:
        raise UnsupportedArchitecture(f"MLP {type(mlp).__name__} is not a gated MLP")
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    if act is None or getattr(attn, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitecture(f"layer {type(layer).__name__} is not supported")
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    window = getattr(attn, "sliding_window", default_window) if hasattr(attn, "sliding_window") else default_window
    return Layer(
        attn_norm=_norm(layer.input_layernorm),
        qkv=qkv,
        o=_cat_linear(attn.o_proj),
        mlp_norm=_norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
        gate_up=gate_up,
        down=_cat_linear(mlp.down_proj),
        act=act,
        rope=rope_key,
        window=window,
        q_norm=_norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
        k_norm=_norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
        attn_post_norm=_norm(layer.post_attention_layernorm) if gemma else None,
        mlp_post_norm=_norm(layer.post_feedforward_layernorm) if gemma else None,
        silu=type(act).__name__ in ("SiLU", "SiLUActivation"),
    )


_STATIC_ROPE = {"default", "linear", "llama3", "yarn", "proportional"}


def from_hf(model: torch.nn.Module) -> Stack:
    """Gather an HF *ForCausalLM's weights; never modifies the model or its config."""
    config = model.config
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if body is None or layers is None or not hasattr(body, "embed_tokens") or not hasattr(model, "lm_head"):
        raise UnsupportedArchitecture(f"{type(model).__name__} does not have model.layers / embed_tokens / lm_head")
    rotary = getattr(body, "rotary_emb", None)
    if rotary is None:
        raise UnsupportedArchitecture(f"{type(model).__name__} has no rotary embedding module")
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    # Mistral-style configs set one window for every layer; per-layer modules override it.
    default_window = getattr(config, "sliding_window", None) if config.model_type in ("mistral",) else None
    built = [
        _layer(layer, layer_types[i] if per_type else "all", default_window) for i, layer in enumerate(layers)
    ]
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attn0 = layers[0].self_attn
    head_dim = getattr(attn0, "head_dim", None) or config.hidden_size // heads
    embed_mod = body.embed_tokens
    scale = getattr(embed_mod, "embed_scale", None)
    rope_params = getattr(config, "rope_parameters", None) or {}
    if per_type:
        rope_types = {(rope_params.get(t) or {}).get("rope_type", "default") for t in set(layer_types)}
    else:
        rope_types = {rope_params.get("rope_type", "default")}
    return Stack(
        embed=embed_mod.weight.detach(),
        embed_scale=None if scale is None else scale.to(embed_mod.weight.dtype),
        layers=built,
        norm=_norm(body.norm),
        lm_head=_cat_linear(model.lm_head),
        n_heads=heads,
        n_kv=kv,
        head_dim=head_dim,
        scale=float(attn0.scaling),
        rotary=rotary,
        rope_keys=tuple(sorted(set(l.rope for l in built))),
        rope_static=rope_types <= _STATIC_ROPE,
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )
