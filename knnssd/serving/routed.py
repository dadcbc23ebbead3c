"""Routed generation: prefill -> prompt vector -> kNN route -> that cluster's drafter -> decode.

The vector comes out of the prefill pass the generation runs anyway, so routing costs one
pooling and one faiss search. ``RoutedGenerator`` is shared by the CLI, the batch flow and
the pyfunc model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from knnssd import models
from knnssd.engine.decode import DecodeStats, GenerationConfig, decode, prefill
from knnssd.engine.drafters import build
from knnssd.engine.params import GenerateParams, prompt_ids
from knnssd.routing import bank as banks

log = logging.getLogger(__name__)


@dataclass
class Result:
    text: str
    tokens: list[int]
    cluster: int | None  # None: no anchor close enough, the fallback configuration drafted
    label: str
    similarity: float
    drafter: str
    stats: DecodeStats
    route_s: float
    latency_s: float
    prompt_tokens: int
    truncated: bool
    vector: np.ndarray  # the prompt vector the router saw

    def to_row(self) -> dict:
        s = self.stats
        return {
            "text": self.text, "tokens": self.tokens, "new_tokens": len(self.tokens), "cluster": self.cluster,
            "label": self.label, "similarity": self.similarity, "matched": self.cluster is not None,
            "drafter": self.drafter, "acceptance_rate": s.acceptance_rate, "mean_accepted": s.mean_accepted,
            "steps": s.steps, "drafted": s.drafted, "accepted": sum(s.accepted), "latency_s": self.latency_s, "route_ms": 1e3 * self.route_s,
            "tokens_per_s": len(self.tokens) / self.latency_s if self.latency_s else 0.0,
            "prompt_tokens": self.prompt_tokens, "truncated": self.truncated, "stop": s.stop,
        }


class RoutedGenerator:
    def __init__(self, lm: models.LoadedModel, bank: banks.Bank):
        self.lm, self.bank = lm, bank
        self.decoder = lm.decoder
        bank.check_model(lm.fingerprint, self.decoder.n_layers)
        if bank.dtype and bank.dtype != lm.dtype_name:
            log.warning("bank was tuned in %s and runs in %s: outputs stay exact, its speedups may not hold "
                        "(calibrate with --dtype %s for this setting)", bank.dtype, lm.dtype_name, lm.dtype_name)
        self.router = bank.router()
        self.drafters = {c.id: build(c.drafter, self.decoder.n_layers, self.decoder.can_skip) for c in bank.clusters}
        self.eos = models.eos_ids(lm)

    @classmethod
    def from_model_uri(cls, model_uri: str, model: str | None = None, dtype: str = "auto", device: str = "auto",
                       tracking_uri: str | None = None) -> "RoutedGenerator":
        """From a registered bank version (``models:/knnssd-smollm2@champion``) or a local bank folder."""
        from knnssd import tracking

        return cls.from_bank_dir(tracking.bank_folder(model_uri, tracking_uri), model, dtype, device)

    @classmethod
    def from_bank_dir(cls, folder: str | Path, model: str | None = None, dtype: str = "auto",
                      device: str = "auto") -> "RoutedGenerator":
        bank = banks.load(folder)
        return cls(models.load(model or bank.model, dtype, device), bank)

    def tokenize(self, prompt: str, limit: int) -> tuple[list[int], bool]:
        return prompt_ids(self.lm.tokenizer, prompt, limit)

    def generate(self, prompt: str, params: GenerateParams = GenerateParams()) -> Result:
        ids, truncated = self.tokenize(prompt, params.max_prompt_tokens)
        with self.lm.busy:  # the model's one decoder is held from prefill to the last token
            return self._generate(ids, truncated, params)

    def _generate(self, ids: list[int], truncated: bool, params: GenerateParams) -> Result:
        t0 = time.perf_counter()
        cfg = GenerationConfig(max_new_tokens=params.max_new_tokens, warp=params.warp, seed=params.seed, eos_ids=self.eos)
        seq, logits, vector, route, t1 = self.prefill_route(ids, cfg)
        cluster = self.bank.cluster(route.cluster)
        route_s = time.perf_counter() - t1
        new, stats = decode(seq, logits, self.drafters.get(cluster.id), cfg)
        stats.prefill_s = t1 - t0
        stats.total_s = time.perf_counter() - t0
        text = self.lm.tokenizer.decode(new, skip_special_tokens=True)
        return Result(text, new, route.cluster, cluster.label, route.similarity, cluster.drafter.describe(), stats,
                      route_s, stats.total_s, len(ids), truncated, vector)

    def prefill_route(self, ids: list[int], cfg: GenerationConfig):
        """Prefill the prompt and route its vector: (sequence, last logits, vector, route, time the
        prefill ended). The caller holds the decoder."""
        pool = self.bank.pooling
        seq, logits, hidden = prefill(self.decoder, ids, cfg, tap=None if pool.layer < 0 else pool.layer)
        t1 = time.perf_counter()
        vector = pool.pool(hidden)
        return seq, logits, vector, self.router.route(vector), t1

    def config_summary(self) -> list[dict]:
        return [{"cluster": c.id, "label": c.label, **asdict(c.drafter), "speedup": c.speedup} for c in self.bank.clusters]
