"""One host read per speculative step (issue 16's CPU part): verification runs on the device and hands
the host one packed verdict; a draft made on the device (``LayerSkip(early_stop=False)``, the default
off the CPU) reads nothing, its confidence cut applied afterwards on the device. Checked by counting
the tensor reads the loop makes, on the CPU (and on CUDA where there is one: there each read is a
device sync, and a step whose attention needs the position on the host would fail here)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from knnssd.engine.spec.loop import GenerationConfig, Run, generate, prefill
from knnssd.engine.spec.drafters import DrafterConfig, LayerSkip, build
from knnssd.engine.spec.sampling import Warp
from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.skip import SkipMask
from tiny import prompt_ids, tiny

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def host_reads():
    """Count the calls that copy a tensor's values to the host."""
    count = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(fn):
        def wrapper(*a, **kw):
            count["n"] += 1
            return fn(*a, **kw)
        return wrapper

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counted(fn))
    try:
        yield count
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def set_early_stop(drafter, early: bool):
    """Make a drafter's layer-skip part (itself, or a hybrid's) stop early on the host or cut on the device."""
    for d in (drafter, getattr(drafter, "layer_skip", None)):
        if isinstance(d, LayerSkip):
            d.early_stop = early
    return drafter


def _drafter(kind: str, n_layers: int, threshold: float):
    cfg = DrafterConfig(kind=kind, mask=SkipMask.from_layers(n_layers, attn=[2], mlp=[1]).to_dict(), max_len=5,
                        threshold=threshold, ngram_sizes=[2, 1])
    return set_early_stop(build(cfg, n_layers), False)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("kind,warp", [
    ("none", Warp()), ("layer_skip", Warp()), ("hybrid", Warp()), ("layer_skip", Warp(0.9, top_k=8)),
])
def test_a_step_reads_the_host_once(kind, warp, device):
    dec = make_decoder(tiny("llama") if device == "cpu" else copy.deepcopy(tiny("llama")).to(device))
    cfg = GenerationConfig(max_new_tokens=24, warp=warp, seed=3)
    seq, logits, _ = prefill(dec, prompt_ids("llama", 0), cfg)
    run = Run(seq, logits, _drafter(kind, dec.n_layers, 0.3), cfg)
    with host_reads() as reads:
        while not run.done:
            run.accept(call := run.propose(), dec.forward(call.ids, call.start, last=call.rows == 1).logits)
    steps = run.stats.steps
    assert steps > 3 and reads["n"] == steps, f"{reads['n']} host reads in {steps} steps"
    if kind != "none":
        assert run.stats.drafted > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.8])
def test_a_draft_cut_on_the_device_gives_the_tokens_of_an_early_stop(arch, threshold):
    """Greedy: drafting all k on the device and cutting at the first token under the threshold verifies
    the same tokens as stopping there; so both equal plain decoding, and they draft the same counts."""
    dec = make_decoder(tiny(arch))
    cfg = GenerationConfig(max_new_tokens=32)
    plain, _ = generate(dec, prompt_ids(arch, 1), None, cfg)
    out = {}
    for early in (True, False):
        drafter = _drafter("layer_skip", dec.n_layers, threshold)
        drafter.early_stop = early
        tokens, stats = generate(dec, prompt_ids(arch, 1), drafter, cfg)
        out[early] = (tokens, stats.drafted, stats.accepted)
    assert out[True][0] == plain and out[True] == out[False]


@pytest.mark.parametrize("pooled", [False, True])
def test_a_batched_step_reads_the_host_once(pooled):
    """Every sequence's verdict of a packed pass comes to the host in one copy."""
    from knnssd.engine.batch.plan import BatchPlan
    from knnssd.engine.batch.scheduler import BatchStats, PromptJob, decode_batch
    from knnssd.engine.model.pass_costs import PassCosts

    dec = make_decoder(tiny("llama"))
    plan = BatchPlan(3, PassCosts((1, 64), (0.01, 0.01)), True, pooled)
    jobs = [PromptJob(prompt_ids("llama", i), _drafter(("layer_skip", "hybrid", "none")[i % 3], dec.n_layers, 0.3),
                      GenerationConfig(max_new_tokens=10 + i)) for i in range(5)]
    stats = BatchStats(3)
    with host_reads() as reads:
        done = list(decode_batch(dec, jobs, plan, stats))
    assert len(done) == 5 and sum(stats.drafted) > 0
    assert reads["n"] == len(stats.rows) + len(jobs)  # one a step, and one a prompt for its first token
