"""Routed generation on the static step (``KNNSSD_GRAPHS``), on a tiny random model on the CPU, where the step
runs eagerly: a prompt's prefill gives its routing vector, single requests and batches give plain greedy
decoding's tokens, and int8 drafts fall back to the full weights."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from knnssd import models, settings
from knnssd.engine import static_slots
from knnssd.engine.drafters import DrafterConfig
from knnssd.engine.graphs import StaticDecoder
from knnssd.engine.params import GenerateParams
from knnssd.engine.skip import SkipMask
from knnssd.routing import bank as banks
from knnssd.routing import router
from knnssd.serving.routed import RoutedGenerator
from tiny import COMMON, hf_greedy, prompt_ids, tiny


class Tokens:
    """A tokenizer for the tiny model: a prompt is its token ids, written with spaces between them."""

    eos_token_id = None

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=[int(t) for t in text.split()])

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def bank(tmp_path, configs: list[DrafterConfig], layer: int = 1) -> banks.Bank:
    """A bank for the tiny Llama: one anchor a configuration, at a random vector of the model's width."""
    x = np.random.default_rng(0).standard_normal((len(configs), COMMON["hidden_size"])).astype(np.float32)
    clusters = router.build_clusters([str(i) for i in range(len(x))], [f"d{i}" for i in range(len(x))], x,
                                     k_per_domain=1)
    results = [banks.ClusterResult(c.id, configs[c.id % len(configs)].to_dict(), speedup=1.2) for c in clusters]
    return banks.from_clusters(clusters, results, "tiny", "abc", COMMON["num_hidden_layers"], "float32",
                               router.Pooling(layer=layer), -1.0, "now")


def loaded() -> models.LoadedModel:
    return models.LoadedModel(name="tiny", model=tiny("llama"), tokenizer=Tokens(), source="tiny", fingerprint="abc")


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


def test_routed_generation_on_the_static_step_gives_plain_greedy_tokens(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KNNSSD_GRAPHS", "on")
    mask = SkipMask.from_layers(4, attn=(1,), mlp=(2,)).to_dict()
    configs = [DrafterConfig(kind="ngram", max_len=4), DrafterConfig(kind="hybrid", mask=mask, max_len=3, int8=True),
               DrafterConfig(kind="none")]
    lm = loaded()
    with caplog.at_level("INFO", logger="knnssd.serving.routed"):
        gen = RoutedGenerator(lm, bank(tmp_path, configs))
    assert isinstance(gen.static, StaticDecoder) and gen.static is lm.static
    assert "clusters that draft on them draft on the full weights" in caplog.text
    skips = [d.layer_skip for d in gen.drafters.values() if hasattr(d, "layer_skip")]
    assert len(skips) == 1 and not skips[0].int8
    params = GenerateParams(max_new_tokens=12)
    prompts = {i: " ".join(map(str, prompt_ids("llama", i))) for i in range(5)}
    want = {i: hf_greedy("llama", i, 12) for i in prompts}
    for i, p in prompts.items():
        assert tuple(gen.generate(p, params).tokens) == want[i], i
    assert lm.static.cache.k[0].abs().sum() > 0  # they ran on it
    with caplog.at_level("INFO", logger="knnssd.serving.routed"):
        chosen = gen.plan(3, 40)  # the form whose packed pass measured cheaper (on this CPU, likely the eager one)
    assert "batches of 3 run on" in caplog.text
    fixed = static_slots.plan(lm.static_slots(3, 40), 3)
    assert fixed.runs_on is lm.static_slots(2, 30)  # the slots made are reused where they hold a batch
    for plan in (chosen, fixed):
        got = dict(gen.generate_many(prompts.items(), params, plan))
        assert {i: tuple(r.tokens) for i, r in got.items()} == want
        assert len({r.cluster for r in got.values()}) > 1  # several clusters' drafters ran
