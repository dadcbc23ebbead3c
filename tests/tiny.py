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
