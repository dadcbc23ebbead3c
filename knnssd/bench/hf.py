"""The HF baseline: ``model.generate`` on the same weights, greedy, timed to the device's end."""
from __future__ import annotations

import time

import torch

from knnssd.engine.model.timing import sync


def hf_generate(lm, ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...], prompt_lookup: int = 0
                ) -> tuple[list[int], float]:
    """(new tokens up to and including the first EOS, seconds); ``prompt_lookup``: HF's prompt-lookup
    decoding with that many tokens per draft (0: plain ``generate``)."""
    x = torch.tensor([ids], device=lm.device)
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    t = time.perf_counter()
    out = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                            pad_token_id=lm.tokenizer.pad_token_id or 0, **extra)
    sync(lm.device)
    s = time.perf_counter() - t
    toks = out[0, len(ids):].tolist()
    cut = next((i + 1 for i, t_ in enumerate(toks) if t_ in set(eos_ids)), len(toks))  # HF pads after EOS
    return toks[:cut], s
