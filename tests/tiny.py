"""Tiny random decoder-only models built from configs in code (no downloads).

Weights are drawn with a larger init scale than HF's default so logits are peaked: greedy
decoding then rarely meets near-ties, where any two correct implementations may differ by
rounding alone.
"""
from __future__ import annotations

import functools

import torch
import transformers as tf

COMMON = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, eos_token_id=1, bos_token_id=0,
    pad_token_id=0, tie_word_embeddings=False,
)

ARCHS = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, attention_bias=True)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=16)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=12)),
    "gemma3": lambda: tf.Gemma3ForCausalLM(
        tf.Gemma3TextConfig(**{**COMMON, "num_key_value_heads": 1}, head_dim=16, sliding_window=10,
                            sliding_window_pattern=2, query_pre_attn_scalar=16)
    ),
    "phi3": lambda: tf.Phi3ForCausalLM(
        tf.Phi3Config(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    ),
}


@functools.lru_cache(maxsize=None)
def tiny(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = ARCHS[arch]().to(dtype).eval()
    model.requires_grad_(False)
    model.generation_config.pad_token_id = 0
    return model


def prompt_ids(arch: str, i: int, length: int = 12) -> list[int]:
    g = torch.Generator().manual_seed(1000 * i + len(arch))
    ids = torch.randint(2, COMMON["vocab_size"], (length,), generator=g).tolist()
    if i % 2:  # a repetitive prompt so n-gram lookup finds matches
        ids = (ids[: length // 3] * 3)[:length]
    return ids


@functools.lru_cache(maxsize=None)
def hf_greedy(arch: str, i: int, max_new: int) -> tuple[int, ...]:
    model = tiny(arch)
    ids = torch.tensor([prompt_ids(arch, i)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
    return tuple(out[0, ids.shape[1]:].tolist())


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 characters that stand for the 256 bytes."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return [chr(c) for c in cs]


def tiny_gguf(path, layers: int = 2, hidden: int = 64, seed: int = 0):
    """A tiny random Llama as a GGUF file (fp32 tensors, a byte-level BPE vocabulary of 260 tokens):
    loads like an embedded model, converted in a second instead of half a minute."""
    import gguf
    import numpy as np

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_chars(), "Ġt"]
    e, f, heads, kv, v = hidden, 2 * hidden, 4, 2, len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(e)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(e // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(v)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (v - 3))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    rng = np.random.default_rng(seed)
    rand = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)  # noqa: E731
    ones = lambda: np.ones(e, np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", rand(v, e))
    w.add_tensor("output_norm.weight", ones())
    w.add_tensor("output.weight", rand(v, e))
    kv_dim = e // heads * kv
    for i in range(layers):
        for name, shape in (("attn_q", (e, e)), ("attn_k", (kv_dim, e)), ("attn_v", (kv_dim, e)),
                            ("attn_output", (e, e)), ("ffn_gate", (f, e)), ("ffn_up", (f, e)), ("ffn_down", (e, f))):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
