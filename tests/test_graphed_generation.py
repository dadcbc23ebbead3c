"""Routed generation on the static step (``KNNSSD_GRAPHS``), on a tiny random model on the CPU, where the step
runs eagerly: a prompt's prefill gives its routing vector, single requests and batches give plain greedy
decoding's tokens on the same step, int8 drafts fall back to the full weights, and a step whose probe is
not exact is left for the eager one."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from knnssd import models, settings
from knnssd.engine.static import slots as static_slots
from knnssd.engine.spec.drafters import DrafterConfig
from knnssd.engine.static.graphs import StaticDecoder
from knnssd.engine.spec.request_params import GenerateParams
from knnssd.engine.model.skip import SkipMask
from knnssd.routing import bank as banks
from knnssd.routing import router
from knnssd.serving.routed import RoutedGenerator
from tiny import COMMON, prompt_ids, tiny


class Tokens:
    """A tokenizer for the tiny model: a prompt is its token ids, written with spaces between them."""

    eos_token_id = None

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=[int(t) for t in text.split()])

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def bank(configs: list[DrafterConfig], layer: int = 1) -> banks.Bank:
    """A bank for the tiny Llama: one anchor a configuration, at a random vector of the model's width."""
    x = np.random.default_rng(0).standard_normal((len(configs), COMMON["hidden_size"])).astype(np.float32)
    clusters = router.build_clusters([str(i) for i in range(len(x))], [f"d{i}" for i in range(len(x))], x,
                                     k_per_domain=1)
    results = [banks.ClusterResult(c.id, configs[c.id % len(configs)].to_dict(), speedup=1.2) for c in clusters]
    return banks.from_clusters(clusters, results, "tiny", "abc", COMMON["num_hidden_layers"], "bfloat16",
                               router.Pooling(layer=layer), -1.0, "now")


def loaded(dtype: torch.dtype = torch.bfloat16) -> models.LoadedModel:
    return models.LoadedModel(name="tiny", model=tiny("llama", dtype=dtype), tokenizer=Tokens(), source="tiny",
                              fingerprint="abc")


def test_graphs_setting(monkeypatch):
    monkeypatch.delenv("KNNSSD_GRAPHS", raising=False)
    assert not settings.graphs(torch.device("cpu")) and settings.graphs(torch.device("cuda"))
    monkeypatch.setenv("KNNSSD_GRAPHS", "on")
    assert settings.graphs(torch.device("cpu"))
    monkeypatch.setenv("KNNSSD_GRAPHS", "off")
    assert not settings.graphs(torch.device("cuda"))
    monkeypatch.setenv("KNNSSD_GRAPHS", "yes")
    with pytest.raises(ValueError, match="KNNSSD_GRAPHS='yes' is not one of auto, on, off"):
        settings.graphs(torch.device("cpu"))


def test_routed_generation_on_the_static_step_equals_its_plain_decoding(monkeypatch, caplog):
    """bf16, where the static step's probe finds it exact on the CPU: routed requests, alone and batched on
    static slots, give the tokens plain decoding gives on the same step."""
    monkeypatch.setenv("KNNSSD_GRAPHS", "on")
    mask = SkipMask.from_layers(4, attn=(1,), mlp=(2,)).to_dict()
    configs = [DrafterConfig(kind="ngram", max_len=4), DrafterConfig(kind="hybrid", mask=mask, max_len=3, int8=True),
               DrafterConfig(kind="none")]
    lm = loaded()
    with caplog.at_level("INFO", logger="knnssd.serving.routed"):
        gen = RoutedGenerator(lm, bank(configs))
    assert isinstance(gen.static, StaticDecoder) and gen.static is lm.static and lm.static.exactness.exact
    assert "clusters that draft on them draft on the full weights" in caplog.text
    skips = [d.layer_skip for d in gen.drafters.values() if hasattr(d, "layer_skip")]
    assert len(skips) == 1 and not skips[0].int8
    params = GenerateParams(max_new_tokens=12)
    prompts = {i: " ".join(map(str, prompt_ids("llama", i))) for i in range(5)}
    plain = RoutedGenerator(lm, gen.bank, plain=True)
    want = {i: plain.generate(p, params).tokens for i, p in prompts.items()}
    for i, p in prompts.items():
        r = gen.generate(p, params)
        assert r.tokens == want[i] and r.stats.step.startswith("static"), i
    assert gen.plan(3).decodes_on is None and gen.plan(3, 40, bound=False).decodes_on is None  # slots that could not grow
    with caplog.at_level("INFO", logger="knnssd.serving.routed"):
        chosen = gen.plan(3, 40)  # the form whose packed pass measured cheaper (on this CPU, likely the eager one)
    assert "batches of 3 run on" in caplog.text
    fixed = static_slots.plan(lm.static_slots(3, 40), 3)
    assert fixed.exact and fixed.decodes_on is lm.static_slots(2, 30)  # slots are reused where they hold a batch
    assert fixed.decodes_on.length == lm.static.keys == 512  # the key bucket every prompt here reads alone
    for plan in (fixed, chosen):  # each batch form against plain decoding in the same form
        base = {i: r.tokens for i, r in plain.generate_many(prompts.items(), params, plan)}
        got = dict(gen.generate_many(prompts.items(), params, plan))
        assert {i: r.tokens for i, r in got.items()} == base
        assert len({r.cluster for r in got.values()}) > 1  # several clusters' drafters ran
        if plan is fixed:  # static slots of the prompts' own key bucket: each prompt's rows are those it has alone
            assert base == want


def test_an_inexact_static_step_is_not_used_where_the_eager_one_is_exact(monkeypatch, caplog):
    monkeypatch.setenv("KNNSSD_GRAPHS", "on")
    lm = loaded(torch.float32)  # fp32 on the CPU: the torch-op step's rows are not row-invariant, the native one's are
    with caplog.at_level("WARNING", logger="knnssd.models"):
        assert lm.static is None and lm.decoder_for(20) is lm.decoder
    assert "the static step's probe found it not exact" in caplog.text


def test_a_server_bounded_by_max_len_batches_on_static_slots(monkeypatch, caplog):
    """``knnssd serve --max-model-len``: with no request reserving more, the batch's plan may run on static slots
    (it measured them), a request over the bound is refused before it is queued, and the batch's answers are
    plain decoding's; without the bound the slots must grow, so static slots are not even measured."""
    from knnssd.serving.batcher import Batcher, serving_plan

    monkeypatch.setenv("KNNSSD_GRAPHS", "on")
    gen = RoutedGenerator(loaded(), bank([DrafterConfig(kind="ngram", max_len=4), DrafterConfig(kind="none")]))
    with caplog.at_level("INFO", logger="knnssd.serving.routed"):
        assert serving_plan(gen, 3, "--batch-size").decodes_on is None
    assert "batches of 3 run on" not in caplog.text
    with caplog.at_level("INFO", logger="knnssd.serving.routed"):
        b = Batcher(lambda: (gen, serving_plan(gen, 3, "--batch-size", max_len=40)), max_len=40)
    try:
        assert "batches of 3 run on" in caplog.text and b.batching
        assert b.limits.positions == 40 and b.limits.bound() == "the server's --max-model-len of 40 tokens"
        assert b.prompt_tokens == 39  # not the default settings' 4096: the slots hold 40
        params = GenerateParams(max_new_tokens=12)
        prompts = [" ".join(map(str, prompt_ids("llama", i))) for i in range(4)]
        plain = RoutedGenerator(gen.lm, gen.bank, plain=True)  # in the plan's form, as the other batch test
        want = [r.tokens for _, r in sorted(plain.generate_many(enumerate(prompts), params, b.plan))]
        assert [r.tokens for r in b.generate(prompts, params)] == want
        ids = prompt_ids("llama", 0)
        with pytest.raises(ValueError, match=f"{len(ids)} tokens of prompt and 40 of completion, more than the "
                                             "server's --max-model-len of 40 tokens"):
            b.submit_ids(ids, False, GenerateParams(max_new_tokens=40))
        assert b.queued == 0
    finally:
        b.close()
