"""The batched engine on static slots (``engine/static/slots.py``), on tiny random models on the CPU: a batch of
more jobs than slots, plain and drafted, gives every prompt HF's greedy tokens; packed rows equal the same rows
alone; the plan measures costs on the runner."""
from __future__ import annotations

import pytest
import torch

from knnssd.engine.batch.scheduler import PromptJob, decode_batch
from knnssd.engine.model.cache import CacheFull
from knnssd.engine.spec.loop import GenerationConfig
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.spec.drafters import LayerSkip, NGram
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.model.weights import from_hf
from knnssd.engine.static.slots import StaticSlots, plan
from tiny import hf_greedy, prompt_ids, tiny


@pytest.mark.parametrize("arch", ("llama", "gemma3"))
def test_a_batch_on_static_slots_gives_each_prompt_its_greedy_tokens(arch):
    static = StaticSlots(Decoder(from_hf(tiny(arch))), slots=3, length=512, graphs=False)
    p = plan(static, 3)
    assert p.pooled and not p.reuses_prefixes and p.costs(1) > 0
    config = GenerationConfig(max_new_tokens=16)
    mask = SkipMask.from_layers(4, attn=(1,), mlp=(2,))
    drafters = (lambda: None, lambda: NGram(max_len=4), lambda: LayerSkip(mask, max_len=3))
    jobs = [PromptJob(prompt_ids(arch, i), drafters[i % 3](), config) for i in range(5)]  # 5 jobs in 3 slots
    done = {id(f.job): f for f in decode_batch(static, jobs, p)}
    for i, job in enumerate(jobs):
        assert tuple(done[id(job)].tokens) == hf_greedy(arch, i, 16), (arch, i)


@pytest.mark.parametrize("slots", (4, 16))
def test_packed_rows_equal_the_same_rows_alone_where_the_probe_says_exact(slots):
    """16 slots: packed passes of up to 129 rows, run in chunks of 64, in the shortest cache the probe allows."""
    static = StaticSlots(Decoder(from_hf(tiny("llama", dtype=torch.bfloat16))), slots=slots, length=312, graphs=False)
    assert static.exactness.exact  # bf16 here: the check below has something to find
    assert static.packed_exact(slots)


def test_static_slots_refuse_what_does_not_fit():
    static = StaticSlots(Decoder(from_hf(tiny("llama"))), slots=2, length=320, graphs=False)
    with pytest.raises(ValueError, match="3 slots asked of static slots that hold 2"):
        static.pooled_slots(3)
    with pytest.raises(CacheFull, match="321 positions"):
        static.views[0].reserve(321)
    with pytest.raises(ValueError, match="at least 312 positions"):
        StaticSlots(Decoder(from_hf(tiny("llama"))), slots=2, length=256, graphs=False)


def test_packed_exact_finds_packed_logits_or_k_v_that_differ(monkeypatch):
    static = StaticSlots(Decoder(from_hf(tiny("llama", dtype=torch.bfloat16))), slots=3, length=312, graphs=False)
    forward_slots = StaticSlots.forward_slots

    def logits_off(self, views, calls):
        return [x + 1 for x in forward_slots(self, views, calls)]

    def kv_off(self, views, calls):
        out = forward_slots(self, views, calls)
        ids, start = calls[-1]
        self.cache.v[0][views[-1].index, :, start + ids.shape[0] - 1] += 1
        return out

    for wrong in (logits_off, kv_off):
        monkeypatch.setattr(StaticSlots, "forward_slots", wrong)
        assert not static.packed_exact(3), wrong.__name__


def test_static_slots_are_as_long_as_their_jobs_key_bucket_within_the_kv_budget():
    from knnssd.engine.static.slots import slots_length

    kv = 1000  # bytes a position
    assert slots_length(4, 40, 4096, kv, 1 << 30) == 512  # the static decoder's bucket for 40 positions
    assert slots_length(4, 600, 4096, kv, 1 << 30) == 1024
    assert slots_length(4, 600, 4096, kv, 5 * 1024 * kv - 1) == 600  # 5 slots of 1,024 would pass the budget
    assert slots_length(4, 5000, 4096, kv, 1 << 30) == 5000  # past the static decoder: no bucket to match
    assert slots_length(4, 40, None, kv, 1 << 30) == 312  # no static decoder: the probe's positions at least
