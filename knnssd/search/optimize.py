"""Per-cluster search for the fastest drafting configuration (Optuna), measured for real.

Two stages, both resumable Optuna studies (``study.py``: any storage; a JournalFileBackend file by
default):

1. **proxy** (cheap, ``proxy.py``): each trial picks a skip mask and draft precision; one
   teacher-forced pass of that draft over the cluster's calib prompts + their AR continuations
   gives, per position, whether the draft's top token matches and how confident it was.
   Replaying the speculative loop on those traces with measured step costs (``costs.py``)
   predicts the speedup of every drafting policy (kind, confidence threshold, max draft length,
   adaptive length, n-gram sizes) at once; the trial keeps the best policy.
2. **real** (measured): the fixed drafters (``drafters.FIXED``: n-gram and suffix lookup, untuned,
   even past ``--minutes``, wherever a lookup kind is searched: ``--kinds layer_skip`` still makes a
   bank of masks), the best pure lookup policies of the
   kinds searched, and the best distinct configurations of stage 1 are timed with the real engine on
   calib prompts, interleaved prompt by prompt with plain AR (suffix drafters with a cache of the
   earlier prompts' outputs, as a bank serves them); the objective is measured speedup = AR time /
   candidate time (equivalently, time per generated token). Plain AR (speedup 1.0) is always a
   candidate, and the fixed drafters are wherever a lookup kind is searched, so no cluster's result is
   slower than them as measured; a tuned configuration is chosen only where it beats them by more
   than the timing's noise (``objective.choose``).

This module runs the two stages for one cluster (``search_cluster``); what each stage maximises is
``objective.py``'s, and the terms are defined in ``proxy.py`` and ``costs.py``.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from knnssd.engine.spec.loop import GenerationConfig
from knnssd.engine.spec.drafters import FIXED, SKIPPING, DrafterConfig, build, fixed_kind, untuned
from knnssd.engine.model.pass_costs import sequence_costs
from knnssd.engine.spec.suffix import SuffixCache
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.skip import SkipMask
from knnssd.routing.bank import ClusterResult
from knnssd.search import cancel, objective
from knnssd.search.budget import Budget
from knnssd.search.costs import Costs
from knnssd.search.proxy import (LOOKUPS, MAX_LENS, NGRAM_SIZES, TREE_KEY, Policy, Sample, Trees, best_policy,
                                 influence, influence_masks, ngram_proposals, proposals_for, simulate, suffix_proposals,
                                 teacher_samples, to_config)
from knnssd.search.study import finished, first_settings, open_study, search_space, trial_mask, trial_params

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SearchModel:
    """The model side of a search: what runs drafts and times them."""

    dec: Decoder
    tokenizer: object
    eos: tuple[int, ...]
    measure_costs: Callable[[], Costs]  # step costs (``costs.measure_costs``), called only for a new study


@dataclass(frozen=True)
class ClusterJob:
    """One cluster's search: its calib prompts and where its studies live (a rerun resumes them)."""

    cluster: int
    texts: list[str]
    storage: object  # an Optuna storage (``study.storage_for``)
    prefix: str  # study names: <prefix>-c<cluster>-proxy / -real
    warm_start: list[dict] = field(default_factory=list)  # stage-1 params tried first (``warm_params``)

    def study(self, stage: str, seed: int):
        return open_study(self.storage, f"{self.prefix}-c{self.cluster}-{stage}", seed=seed)


@dataclass
class Proxy:
    """Stage 1 of one cluster: its study and the traces' inputs (shared with stage 2)."""

    study: object  # optuna.Study
    samples: list[Sample]
    proposals: dict
    kinds: tuple[str, ...]  # layer-skip kinds searched (empty: none, n-gram / AR only)
    costs: Costs  # the step costs the study scores with


def proxy_stage(m: SearchModel, job: ClusterJob, budget: Budget, progress=None, n_trials: int | None = None,
                deadline: float | None = None) -> Proxy:
    """Run stage-1 trials: up to ``budget.proxy_trials`` in the study (``n_trials=None``), or exactly
    ``n_trials`` more (a scale-out worker; several processes or machines may share one study)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dec = m.dec
    samples = teacher_samples(dec, m.tokenizer, job.texts[: budget.proxy_prompts], budget.max_new_tokens, m.eos)
    proposals: dict = {sizes: [ngram_proposals(s, sizes, max(MAX_LENS)) for s in samples] for sizes in NGRAM_SIZES}
    proposals.update({(TREE_KEY, sizes): Trees(samples, max(MAX_LENS), sizes) for sizes in NGRAM_SIZES})
    proposals["suffix"] = [suffix_proposals(s, max(MAX_LENS)) for s in samples]  # the fixed suffix drafter's too
    proposals[(TREE_KEY, "suffix")] = Trees(samples, max(MAX_LENS))
    n = dec.n_layers
    kinds = tuple(k for k in SKIPPING if k in budget.kinds) if dec.can_skip else ()
    proxy = job.study("proxy", budget.seed)
    # every worker of a study, and every resumed run, scores with the step costs the study began with, and
    # searches the precisions it began with
    stored = proxy.user_attrs  # where a study begun before ``first_settings`` keeps them
    if "costs" not in stored:
        def measure() -> dict:
            costs = m.measure_costs()
            return {"costs": asdict(costs), "int8": budget.int8 and costs.int8_pays(n)}

        stored, seeds = first_settings(proxy, measure, trial_params(SkipMask.none(n), False))
    else:
        seeds = False
    c = stored["costs"]
    costs = Costs(c["verify"], {k: tuple(v) for k, v in c["draft"].items()}, c.get("tree", []), c.get("tree_leaf", 0.0))
    search_int8 = budget.int8 and bool(stored.get("int8", True))  # studies from before the int8 rule: budget.int8's
    if seeds and budget.int8 and not search_int8:  # e.g. on CUDA, where _weight_int8pack_mm is slower than bf16
        none = SkipMask.none(n)
        log.info("int8 drafts left out of the search: an int8 draft step costs %.2f ms, a full-precision one "
                 "%.2f ms (measured)", costs.draft_ms(none, True), costs.draft_ms(none, False))
    precisions = [True, False] if search_int8 else [False]
    if not kinds:
        return Proxy(proxy, samples, proposals, kinds, costs)
    if seeds:  # the settings' trial is the full-precision draft with no mask
        if search_int8:
            proxy.enqueue_trial(trial_params(SkipMask.none(n), True))
        for params in job.warm_start:
            if search_int8 or not params.get("int8"):
                proxy.enqueue_trial(params)
        for mask in influence_masks(influence(dec, samples, budget.context)):
            for int8 in precisions:
                proxy.enqueue_trial(trial_params(mask, int8))

    space = search_space(n, precisions)

    def value(trial) -> float:
        return objective.proxy_value(trial, dec, samples, space, budget.context, costs, proposals, kinds)

    remaining = budget.proxy_trials - len(finished(proxy)) if n_trials is None else n_trials
    if remaining > 0:
        timeout = None if deadline is None else max(1.0, 0.6 * (deadline - time.perf_counter()))
        proxy.optimize(value, n_trials=remaining, timeout=timeout,
                       callbacks=[lambda study, trial: cancel.check(), *([progress] if progress else [])])
    return Proxy(proxy, samples, proposals, kinds, costs)


def search_cluster(m: SearchModel, job: ClusterJob, budget: Budget, progress=None) -> ClusterResult:
    """Search one cluster; rerunning with the same storage and prefix resumes where it stopped."""
    import optuna

    t0 = time.perf_counter()
    deadline = t0 + budget.minutes * 60 if budget.minutes else None
    stage1 = proxy_stage(m, job, budget, progress, deadline=deadline)
    real, measured = real_stage(m, job, budget, candidates(stage1, budget, m.dec.n_layers), progress, deadline)
    results = [{**t.user_attrs, "config": json.loads(key), "speedup": t.value}
               for key, t in measured.items() if t.state == optuna.trial.TrialState.COMPLETE]
    best = objective.choose(results, budget.kinds)
    return ClusterResult(
        cluster=job.cluster, config=best["config"], speedup=best["speedup"], acceptance_rate=best["acceptance"],
        mean_accepted=best["mean_accepted"], ms_per_token=best["ms_per_token"],
        ar_ms_per_token=best["ar_ms_per_token"], proxy_speedup=best["proxy_speedup"],
        proxy_trials=len(finished(stage1.study)), real_trials=len(finished(real)), search_s=time.perf_counter() - t0,
        candidates=results, best_fixed_speedup=best["best_fixed_speedup"], timing_noise=best["timing_noise"],
    )


def config_key(cfg: DrafterConfig) -> str:
    """A candidate's configuration as the real study records it (its trials' ``config``)."""
    return json.dumps(cfg.to_dict(), sort_keys=True)


def candidates(stage1: Proxy, budget: Budget, n_layers: int) -> list[tuple[DrafterConfig, float]]:
    """What stage 2 times, each with its proxy speedup: the fixed drafters (so no bank is measured slower
    than them here), the best pure lookup policies of the kinds searched, then up to
    ``budget.real_candidates`` of the best distinct proxy configurations."""
    samples, proposals, costs = stage1.samples, stage1.proposals, stage1.costs
    cands: list[tuple[DrafterConfig, float]] = []
    for kind in FIXED if objective.takes_fixed(budget.kinds) else ():
        cfg = untuned(kind)
        pol = Policy(kind, cfg.max_len, cfg.threshold, cfg.adaptive, tuple(cfg.ngram_sizes))
        sp = simulate(samples, None, pol, costs, 0.0, proposals_for(pol, proposals))[0]
        cands.append((cfg, sp))
    for kind in (k for k in LOOKUPS if k in budget.kinds):
        pol, (sp, _, _) = best_policy(samples, None, costs, 0.0, proposals, (kind,))
        cands.append((to_config(pol, None, False), sp))
    unique: dict[str, tuple[DrafterConfig, float]] = {}  # the best policy may be the fixed one
    for c, sp in cands:
        unique.setdefault(config_key(c), (c, sp))
    cands, seen = list(unique.values()), set(unique)
    scored = [t for t in stage1.study.trials if t.value is not None] if stage1.kinds else []
    quota = budget.real_candidates + len(cands)
    for t in sorted(scored, key=lambda t: -t.value):
        if len(cands) >= quota:
            break
        p = t.user_attrs["policy"]
        cfg = to_config(Policy(p["kind"], p["max_len"], p["threshold"], p["adaptive"], tuple(p["ngram_sizes"]),
                               p.get("tree", 0)),
                        trial_mask(t.params, n_layers), t.params["int8"])
        key = config_key(cfg)
        if key not in seen:
            seen.add(key)
            cands.append((cfg, t.value))
    return cands


def real_stage(m: SearchModel, job: ClusterJob, budget: Budget, cands: list[tuple[DrafterConfig, float]],
               progress=None, deadline: float | None = None) -> tuple[object, dict]:
    """Stage 2: time each candidate not measured yet, interleaved with plain AR prompt by prompt. Past the
    deadline only the fixed drafters are timed; a tuned one only where its proxy speedup beats theirs by more
    than the timing's noise (``objective.worth_timing``). Returns the real study and its measured
    trials by ``config_key``."""
    real = job.study("real", budget.seed)
    measured = {t.user_attrs["config"]: t for t in finished(real) if "config" in t.user_attrs}
    prompt_ids = [m.tokenizer(x).input_ids for x in job.texts[: budget.real_prompts]]
    gen = GenerationConfig(max_new_tokens=budget.max_new_tokens, eos_ids=m.eos)
    if any(cfg.goodput for cfg, _ in cands):
        sequence_costs(m.dec)  # timed once, outside every candidate's timing
    fixed_predicted = max((sp for cfg, sp in cands if fixed_kind(cfg.to_dict())), default=None)
    skipped = 0
    for cfg, proxy_sp in cands:
        cancel.check()
        key = config_key(cfg)
        late = deadline is not None and time.perf_counter() > deadline
        tuned = not fixed_kind(cfg.to_dict())
        if key in measured or (late and tuned):  # the fixed drafters: past it too
            continue
        if tuned:  # the fixed drafters come first, so the noise is theirs and more
            noise = objective.timing_noise([t.user_attrs for t in measured.values()])
            if not objective.worth_timing(proxy_sp, fixed_predicted, noise):
                skipped += 1
                continue
        number = time_candidate(m, real, cfg, proxy_sp, prompt_ids, gen)
        measured[key] = real.trials[number]
        if progress:
            progress(real, real.trials[number])
    if skipped:
        log.info("cluster %s: %d candidate(s) not timed, predicted no faster than the fixed drafters (%.2fx) by the "
                 "timing's noise", job.cluster, skipped, fixed_predicted)
    return real, measured


def time_candidate(m: SearchModel, real, cfg: DrafterConfig, proxy_sp: float, prompt_ids: list[list[int]],
                   gen: GenerationConfig) -> int:
    """Time one candidate against plain AR as a new trial of the real study (pruned where it falls behind,
    failed where the search is cancelled); returns the trial's number."""
    import optuna

    dec = m.dec
    drafter = build(cfg, dec.n_layers, dec.can_skip, SuffixCache() if cfg.kind == "suffix" else None)
    trial = real.ask()
    trial.set_user_attr("config", config_key(cfg))
    trial.set_user_attr("proxy_speedup", proxy_sp)

    def stop() -> None:
        if cancel.requested():  # told failed: a rerun measures the candidate again
            real.tell(trial, state=optuna.trial.TrialState.FAIL)
            cancel.check()

    def report(speedup: float, i: int) -> bool:
        trial.report(speedup, i)
        return trial.should_prune()

    got = objective.measure(dec, drafter, prompt_ids, gen, report, stop)
    for name, value in got.attrs().items():
        trial.set_user_attr(name, value)
    if got.pruned:
        real.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        real.tell(trial, got.speedup)
    return trial.number


def warm_params(config: dict, n_layers: int) -> dict | None:
    """Stage-1 parameters reproducing a configuration's mask and precision (None for n-gram or AR)."""
    cfg = DrafterConfig.from_dict(config)
    if cfg.kind not in SKIPPING or cfg.mask is None:
        return None
    m = SkipMask.from_dict(cfg.mask)
    m.validate(n_layers)
    return trial_params(m, bool(cfg.int8))
