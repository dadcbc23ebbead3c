"""Routed generation: prefill -> prompt vector -> kNN route -> that cluster's drafter -> decode.

The vector comes out of the prefill pass the generation runs anyway, so routing costs one
pooling and one faiss search. ``RoutedGenerator`` is shared by the CLI, the batch flow and
the pyfunc model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from . import bank as banks
from . import models
from .decode import DecodeStats, GenerationConfig, decode, prefill
from .drafters import build
from .sampling import Warp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_prompt_tokens: int = 4096  # longer prompts keep their last tokens (with a warning)

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k", "max_prompt_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ValueError(f"max_new_tokens and max_prompt_tokens must be >= 1, got {self.max_new_tokens} and "
                             f"{self.max_prompt_tokens}")
        self.warp  # validates temperature, top_k, top_p (finite, in range)

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)

    @classmethod
    def from_dict(cls, d: dict) -> "GenerateParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown generation parameters: {sorted(unknown)} (known: {sorted(known)})")
        d = {k: _number(k, v) for k, v in d.items() if v is not None}
        if isinstance(d.get("seed"), int) and d["seed"] < 0:  # seed -1: random
            del d["seed"]
        return cls(**d)


def _number(name: str, v):
    """Integral floats (JSON 8.0) become ints; NaN and inf stay floats, for the checks to name."""
    if isinstance(v, float) and v.is_integer() and name in ("max_new_tokens", "top_k", "max_prompt_tokens", "seed"):
        return int(v)
    return v


def check_prompt(prompt) -> None:
    """A one-line ``ValueError`` for a prompt no model can take: not text, not UTF-8, or blank."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be text, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("prompt is not valid UTF-8 text") from None
    if not prompt.strip():
        raise ValueError("empty prompt")


def prompt_ids(tokenizer, prompt: str, limit: int) -> tuple[list[int], bool]:
    """Token ids of ``prompt``, keeping the last ``limit`` of a longer one (warned); True if truncated.
    The one prompt policy of ``generate``, ``complete`` and serving."""
    check_prompt(prompt)
    ids = tokenizer(prompt).input_ids
    if len(ids) > limit:
        log.warning("prompt of %d tokens truncated to its last %d", len(ids), limit)
        return ids[-limit:], True
    return ids, False


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
        self._busy = lm.busy  # the model's one decoder is held from prefill to the last token

    @classmethod
    def from_model_uri(cls, model_uri: str, model: str | None = None, dtype: str = "auto", device: str = "auto",
                       tracking_uri: str | None = None) -> "RoutedGenerator":
        """From a registered bank version (``models:/knnssd-smollm2@champion``) or a local bank folder."""
        from . import tracking

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
        with self._busy:
            return self._generate(ids, truncated, params)

    def _generate(self, ids: list[int], truncated: bool, params: GenerateParams) -> Result:
        t0 = time.perf_counter()
        cfg = GenerationConfig(max_new_tokens=params.max_new_tokens, warp=params.warp, seed=params.seed, eos_ids=self.eos)
        pool = self.bank.pooling
        seq, logits, hidden = prefill(self.decoder, ids, cfg, tap=None if pool.layer < 0 else pool.layer)
        t1 = time.perf_counter()
        vector = pool.pool(hidden)
        route = self.router.route(vector)
        cluster = self.bank.cluster(route.cluster)
        route_s = time.perf_counter() - t1
        new, stats = decode(seq, logits, self.drafters.get(cluster.id), cfg)
        stats.prefill_s = t1 - t0
        stats.total_s = time.perf_counter() - t0
        text = self.lm.tokenizer.decode(new, skip_special_tokens=True)
        return Result(text, new, route.cluster, cluster.label, route.similarity, cluster.drafter.describe(), stats,
                      route_s, stats.total_s, len(ids), truncated, vector)

    def config_summary(self) -> list[dict]:
        return [{"cluster": c.id, "label": c.label, **asdict(c.drafter), "speedup": c.speedup} for c in self.bank.clusters]
