"""Routed generation: prefill -> prompt vector -> kNN route -> that cluster's drafter -> decode.

The vector comes out of the prefill pass the generation runs anyway, so routing costs one
pooling and one faiss search. ``RoutedGenerator`` is shared by the CLI, the batch flow and
the pyfunc model.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from knnssd import console, models
from knnssd.engine.batch import plan as batch_plan
from knnssd.engine.static import slots as static_slots
from knnssd.engine.batch.plan import BatchPlan
from knnssd.engine.batch.scheduler import BatchStats, decode_batch
from knnssd.engine.spec.loop import DecodeStats, GenerationConfig, Prefill, Run, prefill
from knnssd.engine.spec.drafters import build
from knnssd.engine.static.graphs import CAPTURE_ROWS
from knnssd.engine.model.pass_costs import sequence_costs
from knnssd.engine.spec.suffix import SuffixCache
from knnssd.engine.spec.request_params import GenerateParams, prompt_ids
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
            "text": self.text, "tokens": self.tokens, "new_tokens": len(self.tokens),
            "cluster": None if self.cluster is None else int(self.cluster), "label": self.label,
            "similarity": float(self.similarity) if math.isfinite(self.similarity) else None,  # JSON has no NaN
            "matched": self.cluster is not None,
            "drafter": self.drafter, "acceptance_rate": s.acceptance_rate, "mean_accepted": s.mean_accepted,
            "steps": s.steps, "drafted": s.drafted, "accepted": sum(s.accepted), "latency_s": self.latency_s, "route_ms": 1e3 * self.route_s,
            "tokens_per_s": len(self.tokens) / self.latency_s if self.latency_s else 0.0,
            "prompt_tokens": self.prompt_tokens, "truncated": self.truncated, "stop": s.stop,
        }


class RoutedGenerator:
    def __init__(self, lm: models.LoadedModel, bank: banks.Bank, plain: bool = False):
        self.lm, self.bank, self.plain = lm, bank, plain  # plain: route, but decode without drafting
        self.decoder = lm.decoder
        bank.check_model(lm.fingerprint, self.decoder.n_layers)
        if bank.dtype and bank.dtype != lm.dtype_name:
            log.warning("bank was tuned in %s and runs in %s: outputs stay exact, its speedups may not hold "
                        "(calibrate with --dtype %s for this setting)", bank.dtype, lm.dtype_name, lm.dtype_name)
        self.router = bank.router()
        self.suffix_cache = SuffixCache()  # the earlier outputs of this bank's suffix-drafted sequences
        # the static step (CUDA graphs) where settings.graphs asks for it: one sequence's requests run on it,
        # and a batch where its measured passes are the cheaper (``plan``)
        self.static = lm.static
        if self.static is not None and any(c.drafter.int8 for c in bank.clusters):
            log.info("the static step has no int8 weights: clusters that draft on them draft on the full weights")
        self.drafters = {c.id: self.build(c) for c in [*bank.clusters, bank.unmatched]}
        if self.static is not None and self.static.runner.graphs:
            masks = tuple({c.mask for c in bank.clusters if c.mask is not None})
            try:
                log.info("static step captured for every bucket in %.1f s", self.static.warm(masks))
            except RuntimeError as e:  # out of device memory: the buckets not captured are captured at first use
                log.warning("the static step's buckets could not all be captured now (%s)", console.first_line(e))
        self.eos = models.eos_ids(lm)
        self._int8_weights()
        if any(c.drafter.goodput for c in [*bank.clusters, bank.unmatched]):
            sequence_costs(self.decoder)  # timed now, not in the first request that cuts a draft

    def decoder_for(self, positions: int):
        """The decoder one sequence of ``positions`` (prompt and new tokens) runs on (``LoadedModel.decoder_for``:
        int8 drafts here run on the full weights where the static step runs)."""
        return self.lm.decoder_for(positions)

    def build(self, cluster: banks.BankCluster):
        """A new drafter for ``cluster`` (None: plain decoding); on full weights where the static step runs."""
        cfg = cluster.drafter
        if self.static is not None and cfg.int8:
            cfg = replace(cfg, int8=False)
        return build(cfg, self.decoder.n_layers, self.decoder.can_skip, self.suffix_cache)

    def _int8_weights(self) -> None:
        """Quantise the int8 draft weights now, where a cluster drafts on them, not in the first request
        routed there (it takes about a second)."""
        if self.can_batch and self.static is None and any(c.drafter.int8 for c in self.bank.clusters):
            self.decoder.int8_stack()

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

    def tokenize(self, prompt: str, params: GenerateParams) -> tuple[list[int], bool]:
        """``params``' prompt policy within the model's limits (``engine.spec.request_params.prompt_ids``)."""
        return prompt_ids(self.lm.tokenizer, prompt, params, self.lm.limits)

    def positions(self, prompts: list[str], params: GenerateParams) -> int:
        """The most cache positions a generation of one of ``prompts`` reserves: its prompt as kept
        (``tokenize``) and its new tokens."""
        longest = max(len(self.lm.tokenizer(p).input_ids) for p in prompts)
        return min(longest, self.lm.limits.prompt_tokens(params)) + params.max_new_tokens

    def generate(self, prompt: str, params: GenerateParams = GenerateParams()) -> Result:
        ids, truncated = self.tokenize(prompt, params)
        with self.lm.busy:  # the model's one decoder is held from prefill to the last token
            return self._generate(ids, truncated, params)

    def _generate(self, ids: list[int], truncated: bool, params: GenerateParams) -> Result:
        t0 = time.perf_counter()
        job = RoutedJob(self, ids, truncated, params)
        new, stats = job.start(self.decoder_for(len(ids) + params.max_new_tokens), drafter=self.drafters.get).complete()
        stats.total_s = time.perf_counter() - t0
        return job.result(new, stats)

    def generate_many(self, prompts: Iterable[tuple[object, str]], params: GenerateParams, plan: BatchPlan,
                      stats: BatchStats | None = None, on_step: Callable[[list], None] | None = None
                      ) -> Iterator[tuple[object, Result]]:
        """(key, Result) for each (key, prompt), ``plan.slots`` sequences decoded together
        (``engine.batch.scheduler``), yielded as each finishes; ``stats`` collects the per-step figures, and
        ``on_step`` is called after each step (``engine.batch.scheduler.Scheduler``). Each
        sequence drafts with its own copy of its cluster's drafter; its tokens equal its
        one-at-a-time generation's where ``plan.exact``."""
        jobs = ((key, *self.tokenize(prompt, params)) for key, prompt in prompts)
        jobs = (RoutedJob(self, ids, truncated, params, key) for key, ids, truncated in jobs)
        with self.lm.busy:  # the decoder's weights are shared by the slots; single generations wait
            for f in decode_batch(self.decoder, jobs, plan, stats, on_step=on_step):
                yield f.job.key, f.job.result(f.tokens, f.stats)

    @property
    def can_batch(self) -> bool:
        """The lean decoder runs sequences in slots; the HF fallback runs one at a time."""
        return self.decoder.can_batch

    def plan(self, slots: int, positions: int = 0, bound: bool = True) -> BatchPlan:
        """A batched run's measured plan (``engine.batch.plan.plan``; ``positions``: the most a job reserves,
        prompt and new tokens, when known). Where the static step runs, ``positions`` is known and ``bound`` (no
        job will reserve more: static slots do not grow), and ``slots`` fit one captured bucket, static slots
        are measured too, and the plan whose packed pass costs less is returned (exactness first); a plan on
        static slots runs there (``BatchPlan.decodes_on``)."""
        plan = batch_plan.plan(self.decoder, slots, positions, record=self.lm.batch_record)
        self._int8_weights()  # again, where the plan gave the decoder other forms of its linears
        if self.static is None or not (bound and positions):
            return plan
        if slots > CAPTURE_ROWS:
            log.info("batches of %d run on the eager engine: static slots are captured for %d rows at most", slots,
                     CAPTURE_ROWS)
            return plan
        try:
            fixed = static_slots.plan(self.lm.static_slots(slots, positions), slots)
        except (RuntimeError, ValueError) as e:  # out of memory, or a cache the probe cannot fit: eager it is
            self.lm.drop_static_slots()
            log.warning("batches run eagerly: static slots of %d sequences failed (%s)", slots, console.first_line(e))
            return plan
        # one row a sequence, as plain decoding packs them: the form whose pass costs less, exactness first (the
        # eager plan times its passes over a short context, the static slots over their whole length: a long
        # batch leans to the eager engine)
        eager_s, fixed_s = plan.costs(slots), fixed.costs(slots)
        use = fixed if (fixed.exact, -fixed_s) > (plan.exact, -eager_s) else plan
        log.info("batches of %d run on %s: a packed pass of %d rows %.2f ms on static slots, %.2f ms eagerly",
                 slots, "static slots" if use is fixed else "the eager engine", slots, 1e3 * fixed_s, 1e3 * eager_s)
        if use is plan:
            self.lm.drop_static_slots()
        return use

    def prefill_route(self, ids: list[int], cfg: GenerationConfig, decoder=None, prefill: Prefill = prefill):
        """Prefill the prompt on ``decoder`` (default: the generator's own) with ``prefill`` and route its
        vector: (sequence, last logits, vector, route, time the prefill ended). The caller holds the decoder."""
        pool = self.bank.pooling
        seq, logits, hidden = prefill(decoder or self.decoder, ids, cfg, tap=None if pool.layer < 0 else pool.layer)
        t1 = time.perf_counter()
        vector = pool.pool(hidden)
        return seq, logits, vector, self.router.route(vector), t1


@dataclass
class RoutedJob:
    """One prompt of a routed generation (``engine.batch.scheduler.Job``): its prefill picks its drafter."""

    gen: RoutedGenerator
    ids: list[int]
    truncated: bool
    params: GenerateParams
    key: object = None
    route: object = None  # set by start
    vector: np.ndarray | None = None
    route_s: float = 0.0
    cancelled: bool = False  # ``Job.cancelled``: set by a server whose client went away

    def start(self, slot, prefill: Prefill = prefill, drafter=None) -> Run:
        """Prefill on ``slot`` (with ``prefill``: a batch's ``Prefixes.prefill`` reuses its other prompts'
        leading positions), route, and return the sequence's ``Run`` with its cluster's drafter
        (``drafter(cluster_id)``; default a new one, for a sequence of a batch)."""
        g, p = self.gen, self.params
        cfg = GenerationConfig(max_new_tokens=p.max_new_tokens, warp=p.warp, seed=p.seed, eos_ids=g.eos,
                               stop_strings=p.stop)
        t0 = time.perf_counter()
        seq, logits, self.vector, self.route, t1 = g.prefill_route(self.ids, cfg, slot, prefill)
        cluster = g.bank.cluster(self.route.cluster)
        self.route_s = time.perf_counter() - t1
        if g.plain:
            d = None
        else:
            d = drafter(cluster.id) if drafter is not None else g.build(cluster)
        run = Run(seq, logits, d, cfg, g.lm.tokenizer if p.stop else None)
        run.stats.prefill_s = t1 - t0
        return run

    def result(self, new: list[int], stats: DecodeStats) -> Result:
        g = self.gen
        cluster = g.bank.cluster(self.route.cluster)
        text = g.lm.tokenizer.decode(new, skip_special_tokens=True)
        return Result(text, new, self.route.cluster, cluster.label, self.route.similarity,
                      "none" if g.plain else cluster.drafter.describe(),
                      stats, self.route_s, stats.total_s, len(self.ids), self.truncated, self.vector)
