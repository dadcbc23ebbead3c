"""SmolLM2's GGUF blocks, packed for a GPU machine whose Python has torch and transformers only (no ``gguf``):
read from the file by HF parameter name (``read_blocks``, for ``benchmarks/gpu_pack.py``), de-quantized in torch
as ``gguf`` de-quantizes them and loaded as the model (``load_packed``, for ``benchmarks/gpu_check.py``).

A packed tensor is ``dict(type, shape, data)``: its GGUF type (Q4_1, Q8_0 or F32), its (rows, columns) and its raw
blocks as uint8 rows, the query and key rows already in HF's order."""
from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("Q4_1", "Q8_0", "F32")  # what ``dequantize`` reads: SmolLM2's file holds these alone

GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def hf_name(name: str) -> str:
    """The HF parameter name of a GGUF tensor (``blk.3.attn_q.weight``: ``model.layers.3.self_attn.q_proj.weight``)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, _ = name.split(".")
    return f"model.layers.{layer}.{GGUF_NAMES[kind]}.weight"


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """GGUF's query/key rows (llama.cpp interleaves each head's rotary halves) in HF's order, as transformers
    reorders the de-quantized rows; whole rows move, so the blocks of each row stay as they are."""
    n = rows.shape[0]
    return rows.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(n, -1)


def read_blocks(path: Path, config: dict) -> dict[str, dict]:
    """Every tensor of the GGUF file at ``path``, packed, by HF parameter name (``config``: the model's HF config,
    for its query and key heads); a type ``dequantize`` does not read ends the run in one line."""
    import gguf

    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind not in KINDS:
            raise SystemExit(f"{t.name} is {kind}: gpu_check de-quantizes Q4_1, Q8_0 and F32 only")
        shape = tuple(int(x) for x in reversed(t.shape))  # (rows, columns)
        data = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(shape[0], -1)
        name = hf_name(t.name)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            data = unpermute_rows(data, heads)
        out[name] = dict(type=kind, shape=shape, data=data.contiguous())
    return out


def dequantize(b: dict) -> torch.Tensor:
    """The fp32 weights of one packed tensor: ``gguf``'s de-quantization in torch, the same
    operations in the same order (Q4_1: d q + m, Q8_0: q d, per block of 32)."""
    data, shape = b["data"], tuple(b["shape"])
    if b["type"] == "F32":
        return data.contiguous().view(torch.float32).reshape(shape)
    width = 34 if b["type"] == "Q8_0" else 20  # bytes a block: fp16 d (and m), then 32 int8 or 32 nibbles
    blk = data.reshape(-1, width)
    d = blk[:, :2].contiguous().view(torch.float16).float()  # (blocks, 1)
    if b["type"] == "Q8_0":
        return (blk[:, 2:].contiguous().view(torch.int8).float() * d).reshape(shape)
    m = blk[:, 2:4].contiguous().view(torch.float16).float()
    qs = blk[:, 4:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=1).float()  # the low nibbles are a block's first 16 values
    return (d * q + m).reshape(shape)


def load_packed(folder: Path, device: torch.device):
    """SmolLM2 and its tokenizer from ``gpu_pack.py``'s folder (its ``a/`` and ``b/`` parts), in bf16."""
    import transformers as tf

    first = folder / "a"
    config = tf.AutoConfig.from_pretrained(first)
    tok = tf.AutoTokenizer.from_pretrained(first)
    blocks = {}
    for part in sorted(folder.glob("*/blocks-*.pt")):
        blocks.update(torch.load(part, weights_only=True))
    # built in bf16 as from_pretrained(dtype=bf16) builds it: its rotary buffers made, and kept in fp32
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {name: dequantize(b) for name, b in blocks.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"{folder}: the packed weights do not fit the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False), tok
