"""The peer a CPU user would pick instead of knnssd, for ``bench-throughput``: llama.cpp through
``llama-cpp-python`` (the optional ``peers`` extra, which builds llama.cpp from source) on the same
GGUF file, one prompt after another, greedy, with and without prompt-lookup decoding
(``LlamaPromptLookupDecoding``, llama.cpp's n-gram drafter).

llama.cpp multiplies the GGUF's quantized blocks (SmolLM2's file is Q4_1) where knnssd runs the
dequantized weights in bf16 or fp32, so its tokens are not expected to equal knnssd's: the table
reports the fraction that do. Each prompt's tokens are the same ids knnssd decodes (its chat template
applied), and a generation stops at the same end-of-sequence ids or token count, the end token
counted as knnssd counts it.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from knnssd import models

LOOKUP_TOKENS = 10  # tokens per lookup draft: llama-cpp-python's default


def available() -> bool:
    """llama-cpp-python is installed and its library loads."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def generate(gguf: Path, prompt_ids: list[list[int]], max_new_tokens: int, eos: tuple[int, ...], threads: int,
             lookup: bool) -> list[tuple[list[int], float]]:
    """(tokens, seconds) of each prompt, one after another, each from an empty cache, on one llama.cpp
    context of ``threads`` threads (the seconds of its loading and of an untimed first call excluded)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if lookup else None
    # with a draft model llama-cpp-python keeps every position's logits, but sizes their buffer by the
    # ``logits_all`` argument (0.3.36: a shape error at the first draft): ask for them
    positions = max(map(len, prompt_ids)) + max_new_tokens + LOOKUP_TOKENS + 16  # a last draft may pass the end
    llm = Llama(model_path=str(gguf), n_ctx=positions, n_batch=512, n_threads=threads, n_threads_batch=threads,
                draft_model=draft, logits_all=lookup, verbose=False)
    out = []
    try:
        next(llm.generate(prompt_ids[0], temp=0.0, top_k=1, reset=True))  # untimed: a first call took seconds
        for ids in prompt_ids:
            llm.reset()  # no prefix kept from the last prompt (``generate`` reuses a matching one): each cold
            t0 = time.perf_counter()
            tokens: list[int] = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                tokens.append(tok)
                if tok in eos or len(tokens) == max_new_tokens:
                    break
            out.append((tokens, time.perf_counter() - t0))
    finally:
        llm.close()
    return out
