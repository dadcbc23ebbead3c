"""Llama shapes to measure with random weights: speeds hold on them, drafters' acceptance does not. SmolLM2-135M's
shape (the GPU check's model where its weights are not carried), Llama-2-7B's (a large model's bandwidth floor)
and a tiny one (a run that checks a script, on any device)."""
from __future__ import annotations

import torch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
               rms_norm_eps=1e-5)
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=32, max_position_embeddings=4096, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)


def llama(shape: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A random-weight Llama of ``shape``, built in bf16 on ``device``."""
    import transformers as tf

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**shape, initializer_range=0.05))
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)
