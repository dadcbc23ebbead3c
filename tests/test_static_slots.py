"""The batched engine on static slots (``engine/static_slots.py``), on tiny random models on the CPU: a batch of
more jobs than slots, plain and drafted, gives every prompt HF's greedy tokens; packed rows equal the same rows
alone; the plan measures costs on the runner."""
from __future__ import annotations

import pytest
import torch

from knnssd.engine.batched import PromptJob, decode_batch
from knnssd.engine.cache import CacheFull
from knnssd.engine.decode import GenerationConfig
from knnssd.engine.decoder import Decoder
from knnssd.engine.drafters import LayerSkip, NGram
from knnssd.engine.skip import SkipMask
from knnssd.engine.stack import from_hf
from knnssd.engine.static_slots import StaticSlots, plan
from tiny import hf_greedy, prompt_ids, tiny


@pytest.mark.parametrize("arch", ("llama", "gemma3"))
def test_a_batch_on_static_slots_gives_each_prompt_its_greedy_tokens(arch):
    static = StaticSlots(Decoder(from_hf(tiny(arch))), slots=3, length=512, graphs=False)
    p = plan(static, 3)
    assert p.pooled and not p.shares and p.costs(1) > 0
    config = GenerationConfig(max_new_tokens=16)
    mask = SkipMask.from_layers(4, attn=(1,), mlp=(2,))
    drafters = (lambda: None, lambda: NGram(max_len=4), lambda: LayerSkip(mask, max_len=3))
    jobs = [PromptJob(prompt_ids(arch, i), drafters[i % 3](), config) for i in range(5)]  # 5 jobs in 3 slots
    done = {id(f.job): f for f in decode_batch(static, jobs, p)}
    for i, job in enumerate(jobs):
        assert tuple(done[id(job)].tokens) == hf_greedy(arch, i, 16), (arch, i)


def test_packed_rows_equal_the_same_rows_alone_where_the_probe_says_exact():
    static = StaticSlots(Decoder(from_hf(tiny("llama", dtype=torch.bfloat16))), slots=4, length=512, graphs=False)
    assert static.packed_exact(4) == static.exactness.exact


def test_static_slots_refuse_what_does_not_fit():
    static = StaticSlots(Decoder(from_hf(tiny("llama"))), slots=2, length=320, graphs=False)
    with pytest.raises(ValueError, match="3 slots asked of static slots that hold 2"):
        static.pooled_slots(3)
    with pytest.raises(CacheFull, match="321 positions"):
        static.views[0].reserve(321)
    with pytest.raises(ValueError, match="at least 312 positions"):
        StaticSlots(Decoder(from_hf(tiny("llama"))), slots=2, length=256, graphs=False)
