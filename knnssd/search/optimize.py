"""Per-cluster search for the fastest drafting configuration (Optuna), measured for real.

Two stages, both resumable Optuna studies (any storage; a JournalFileBackend file by default):

1. **proxy** (cheap): each trial picks a skip mask and draft precision; one teacher-forced
   pass of that draft over the cluster's calib prompts + their AR continuations gives, per
   position, whether the draft's top token matches and how confident it was. Replaying the
   speculative loop on those traces with measured step costs (``Costs``) predicts the speedup
   of every drafting policy (kind, confidence threshold, max draft length, adaptive length,
   n-gram sizes) at once; the trial keeps the best policy.
2. **real** (measured): the best distinct configurations of stage 1, the best pure n-gram
   policy and plain AR are timed with the real engine on calib prompts, interleaved prompt
   by prompt with plain AR; the objective is measured speedup = AR time / candidate time
   (equivalently, time per generated token). Plain AR (speedup 1.0) is always a candidate, so
   no cluster's result is slower than AR as measured.

Terms: a policy's ``k`` is its max draft length; ``v(T)`` the measured time of one full-model
pass over T tokens; ``c`` the measured time of one draft step for a mask and precision.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from knnssd.engine.decode import GenerationConfig, acceptance_rate, generate, mean_accepted
from knnssd.engine.drafters import DrafterConfig, NGram, adapt_length, build
from knnssd.engine.skip import Decoder, SkipMask
from knnssd.engine.timing import pass_timer

log = logging.getLogger(__name__)

THRESHOLDS = (0.0, 0.3, 0.5, 0.7, 0.9)
MAX_LENS = (2, 3, 4, 6, 8, 10)
NGRAM_SIZES = ((3, 2, 1), (3, 2), (4, 3, 2))


@dataclass
class Budget:
    proxy_trials: int = 40  # stage 1 trials (masks)
    real_candidates: int = 4  # stage 2 configurations timed besides plain AR
    minutes: float | None = None  # wall-clock cap for the whole search of one cluster
    proxy_prompts: int = 8  # calib prompts used for traces
    real_prompts: int = 4  # calib prompts timed per candidate
    max_new_tokens: int = 64
    context: int = 192  # prompt tokens kept in teacher-forced passes
    seed: int = 0
    kinds: tuple[str, ...] = ("layer_skip", "ngram", "hybrid")  # drafter kinds searched (plain AR always is)
    int8: bool = True  # allow int8 draft weights (False: the paper's pure layer skipping)

    def __post_init__(self):
        unknown = set(self.kinds) - {"layer_skip", "ngram", "hybrid"}
        if unknown or not self.kinds:
            raise ValueError(f"unknown drafter kinds {sorted(unknown)}; choose from layer_skip, ngram, hybrid")
        self.kinds = tuple(self.kinds)


@dataclass
class Costs:
    """Measured step times (ms) at a typical context; draft cost is linear in kept sub-layers."""

    verify: list[float]  # verify[T-1]: one full pass over T tokens; verify[0] is a plain AR step
    draft: dict[str, tuple[float, float, float]]  # precision -> (base, per attention, per MLP)

    def draft_ms(self, mask: SkipMask, int8: bool) -> float:
        base, attn, mlp = self.draft["int8" if int8 else "full"]
        return base + attn * (mask.n_layers - sum(mask.attn)) + mlp * (mask.n_layers - sum(mask.mlp))

    def verify_ms(self, t: int) -> float:
        return self.verify[min(t, len(self.verify)) - 1]


@torch.inference_mode()
def measure_costs(dec: Decoder, max_t: int = 11, context: int = 128) -> Costs:
    ms = pass_timer(dec, context, max_t)
    verify = [ms(t) for t in range(1, max_t + 1)]
    n = dec.n_layers
    draft = {}
    for name, stack in (("full", None), ("int8", dec.int8_stack() if dec.can_skip else None)):
        if name == "int8" and stack is None:
            continue
        t = {}
        for key, mask in (("none", SkipMask.none(n)), ("attn", SkipMask.from_layers(n, attn=range(n))),
                          ("mlp", SkipMask.from_layers(n, mlp=range(n))),
                          ("all", SkipMask.from_layers(n, attn=range(n), mlp=range(n)))):
            t[key] = ms(1, mask, stack)
        attn = max(0.0, (t["none"] - t["attn"] + t["mlp"] - t["all"]) / (2 * n))
        mlp = max(0.0, (t["none"] - t["mlp"] + t["attn"] - t["all"]) / (2 * n))
        draft[name] = (t["all"], attn, mlp)
    return Costs(verify, draft)


def trial_params(mask: SkipMask, int8: bool) -> dict:
    """A draft's mask and precision as stage-1 trial parameters: ``int8``, ``a{i}`` and ``m{i}`` (skip layer i's
    attention / MLP). The one encoding of a mask in a study; ``trial_mask`` reads it back."""
    return {"int8": bool(int8), **{f"a{i}": bool(b) for i, b in enumerate(mask.attn)},
            **{f"m{i}": bool(b) for i, b in enumerate(mask.mlp)}}


def trial_mask(params: dict, n_layers: int) -> SkipMask:
    return SkipMask(tuple(params[f"a{i}"] for i in range(n_layers)), tuple(params[f"m{i}"] for i in range(n_layers)))


FREE = 1e-4  # a sub-layer whose update is this small next to the residual stream changes (almost) nothing


@torch.inference_mode()
def influence(dec: Decoder, samples: list["Sample"], context: int) -> torch.Tensor:
    """(2, L): each attention (row 0) and MLP (row 1) sub-layer's update relative to the residual stream,
    averaged over teacher-forced passes of the samples (``Decoder.forward(influence=True)``)."""
    total = torch.zeros(2, dec.n_layers)
    for s in samples:
        ids = torch.tensor(s.prompt[-context:] + s.cont, dtype=torch.long, device=dec.device)
        total += dec.forward(ids, 0, influence=True).influence
    return total / max(1, len(samples))


def influence_masks(sizes: torch.Tensor) -> list[SkipMask]:
    """The search's first masks: skip the least influential sub-layers, first all the (near) free ones
    (update < ``FREE``), then the smallest eighth and quarter of them."""
    n = sizes.shape[1]
    order = sizes.flatten().argsort(stable=True).tolist()  # j < n: attention of layer j; else MLP of layer j - n
    counts = list(dict.fromkeys(c for c in (int((sizes < FREE).sum()), 2 * n // 8, 2 * n // 4) if c))
    return [SkipMask.from_layers(n, attn=[j for j in order[:c] if j < n], mlp=[j - n for j in order[:c] if j >= n])
            for c in counts]


@dataclass
class Trace:
    """One teacher-forced draft pass: per continuation position, top-1 match and its probability."""

    match: np.ndarray  # (n,) bool
    conf: np.ndarray  # (n,) float32


@dataclass
class Sample:
    prompt: list[int]  # full prompt ids (n-gram lookup sees all of it)
    cont: list[int]  # plain AR continuation


def teacher_samples(dec, tokenizer, texts: list[str], budget: Budget, eos: tuple[int, ...]) -> list[Sample]:
    out = []
    for text in texts[: budget.proxy_prompts]:
        ids = tokenizer(text).input_ids
        cont, _ = generate(dec, ids, None, GenerationConfig(max_new_tokens=budget.max_new_tokens, eos_ids=eos))
        out.append(Sample(ids, cont))
    return out


@torch.inference_mode()
def trace(dec: Decoder, samples: list[Sample], mask: SkipMask, int8: bool, context: int) -> list[Trace]:
    stack = dec.int8_stack() if int8 else None
    out = []
    for s in samples:
        ctx = s.prompt[-context:]
        ids = torch.tensor(ctx + s.cont, dtype=torch.long, device=dec.stack.device)
        logits = dec.forward(ids, 0, mask, stack).logits[len(ctx) - 1 : -1]
        p = logits.softmax(-1)
        conf, top = p.max(-1)
        out.append(Trace((top.cpu() == torch.tensor(s.cont)).numpy(), conf.cpu().numpy()))
    return out


@dataclass(frozen=True)
class Policy:
    kind: str  # "layer_skip" | "hybrid" | "ngram"
    max_len: int
    threshold: float = 0.0
    adaptive: bool = False
    ngram_sizes: tuple[int, ...] = (3, 2, 1)


def _ngram_proposals(sample: Sample, sizes: tuple[int, ...], max_len: int) -> list[list[int]]:
    """proposal[j] = what NGram would propose after prompt + cont[:j] (for j = 1..n-1)."""
    ng = NGram(sizes, max_len)
    key = object()
    return [[]] + [ng.lookup(key, sample.prompt + sample.cont[:j], max_len) for j in range(1, len(sample.cont))]


def simulate(samples: list[Sample], traces: list[Trace] | None, policy: Policy, costs: Costs, draft_ms: float,
             proposals: list[list[list[int]]] | None) -> tuple[float, float, float]:
    """Replay the speculative loop on teacher-forced traces: (predicted decode speedup, acceptance, mean accepted)."""
    spec_t = ar_t = 0.0
    drafted = accepted = steps = 0
    for si, s in enumerate(samples):
        n = len(s.cont)
        j, k = 1, policy.max_len  # cont[0] comes from the prefill in both AR and speculative decoding
        while j < n:
            room = n - j - 1
            d_tokens: list[bool] = []
            cost = 0.0
            prop = proposals[si][j] if proposals is not None and policy.kind in ("ngram", "hybrid") else []
            kk = min(k, room)
            if prop and kk > 0:
                prop = prop[:kk]
                d_tokens = [prop[i] == s.cont[j + i] for i in range(len(prop))]
            elif policy.kind != "ngram" and kk > 0:
                tr = traces[si]
                for i in range(kk):
                    d_tokens.append(bool(tr.match[j + i]))
                    if tr.conf[j + i] < policy.threshold:
                        break
                cost = draft_ms * len(d_tokens)
            a = 0
            while a < len(d_tokens) and d_tokens[a]:
                a += 1
            spec_t += cost + costs.verify_ms(len(d_tokens) + 1)
            emitted = min(a + 1, n - j)
            ar_t += emitted * costs.verify_ms(1)
            drafted += len(d_tokens)
            accepted += a
            steps += 1
            if policy.adaptive:
                k = adapt_length(k, policy.max_len, len(d_tokens), a)
            j += a + 1
    speedup = ar_t / spec_t if spec_t else 1.0
    return speedup, acceptance_rate(accepted, drafted), mean_accepted(accepted, steps)


def best_policy(samples, traces, costs, draft_ms, proposals_by_sizes, kinds) -> tuple[Policy, tuple[float, float, float]]:
    best, best_res = None, (0.0, 0.0, 0.0)
    for kind in kinds:
        sizes_opts = NGRAM_SIZES if kind in ("ngram", "hybrid") else (NGRAM_SIZES[0],)
        thr_opts = THRESHOLDS if kind != "ngram" else (0.0,)
        for sizes, thr, k, adaptive in itertools.product(sizes_opts, thr_opts, MAX_LENS, (False, True)):
            pol = Policy(kind, k, thr, adaptive, sizes)
            res = simulate(samples, traces, pol, costs, draft_ms, proposals_by_sizes.get(sizes))
            if res[0] > best_res[0]:
                best, best_res = pol, res
    return best, best_res


def to_config(policy: Policy, mask: SkipMask | None, int8: bool) -> DrafterConfig:
    if policy.kind == "ngram":
        return DrafterConfig(kind="ngram", max_len=policy.max_len, adaptive=policy.adaptive,
                             ngram_sizes=list(policy.ngram_sizes))
    return DrafterConfig(kind=policy.kind, mask=mask.to_dict(), max_len=policy.max_len, threshold=policy.threshold,
                         int8=int8, ngram_sizes=list(policy.ngram_sizes), adaptive=policy.adaptive)


@dataclass
class ClusterResult:
    cluster: int
    config: dict  # DrafterConfig.to_dict() of the winner ("none" = plain AR)
    speedup: float  # measured on calib prompts (>= 1.0: plain AR is a candidate)
    acceptance_rate: float
    mean_accepted: float
    ms_per_token: float
    ar_ms_per_token: float
    proxy_speedup: float
    proxy_trials: int
    real_trials: int
    search_s: float
    candidates: list[dict] = field(default_factory=list)  # every measured candidate

    def to_dict(self) -> dict:
        return asdict(self)


def _study(storage, name: str, direction: str = "maximize", seed: int = 0):
    import optuna

    with warnings.catch_warnings():  # multivariate TPE is "experimental"; its per-trial notices are noise here
        warnings.simplefilter("ignore")
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, multivariate=True,
                                             warn_independent_sampling=False)
    return optuna.create_study(storage=storage, study_name=name, direction=direction, sampler=sampler,
                               pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
                               load_if_exists=True)


def storage_for(url_or_path: str):
    """An Optuna storage: a journal file path (default) or any storage URL (sqlite:///, postgresql://, ...)."""
    import optuna

    if "://" in url_or_path:
        return url_or_path
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    Path(url_or_path).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(url_or_path, lock_obj=JournalFileOpenLock(url_or_path)))


def _done(study) -> list:
    import optuna

    return [t for t in study.trials if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)]


@dataclass
class Proxy:
    """Stage 1 of one cluster: its study and the traces' inputs (shared with stage 2)."""

    study: object  # optuna.Study
    samples: list[Sample]
    proposals: dict
    kinds: tuple[str, ...]  # layer-skip kinds searched (empty: none, n-gram / AR only)


def proxy_stage(dec, tokenizer, cluster_id: int, texts: list[str], budget: Budget, storage, study_prefix: str,
                eos: tuple[int, ...], costs: Costs, warm_start: list[dict] | None = None, progress=None,
                n_trials: int | None = None, deadline: float | None = None) -> Proxy:
    """Run stage-1 trials: up to ``budget.proxy_trials`` in the study (``n_trials=None``), or exactly
    ``n_trials`` more (a scale-out worker; several processes or machines may share one study)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    samples = teacher_samples(dec, tokenizer, texts, budget, eos)
    proposals = {sizes: [_ngram_proposals(s, sizes, max(MAX_LENS)) for s in samples] for sizes in NGRAM_SIZES}
    n = dec.n_layers
    kinds = tuple(k for k in ("layer_skip", "hybrid") if k in budget.kinds) if dec.can_skip else ()
    precisions = [True, False] if budget.int8 else [False]
    proxy = _study(storage, f"{study_prefix}-c{cluster_id}-proxy", seed=budget.seed)
    if not kinds:
        return Proxy(proxy, samples, proposals, kinds)
    stored = proxy.user_attrs.get("costs")  # every worker of a study scores with the same step costs
    if stored:
        costs = Costs(stored["verify"], {k: tuple(v) for k, v in stored["draft"].items()})
    else:
        proxy.set_user_attr("costs", asdict(costs))
    if not proxy.trials:
        for int8 in precisions:
            proxy.enqueue_trial(trial_params(SkipMask.none(n), int8))
        for params in warm_start or []:
            if budget.int8 or not params.get("int8"):
                proxy.enqueue_trial(params)
        for mask in influence_masks(influence(dec, samples, budget.context)):
            for int8 in precisions:
                proxy.enqueue_trial(trial_params(mask, int8))

    def objective(trial):
        int8 = trial.suggest_categorical("int8", precisions)
        attn = [trial.suggest_categorical(f"a{i}", [False, True]) for i in range(n)]
        mlp = [trial.suggest_categorical(f"m{i}", [False, True]) for i in range(n)]
        mask = SkipMask(tuple(attn), tuple(mlp))
        traces = trace(dec, samples, mask, int8, budget.context)
        pol, (sp, acc, mean) = best_policy(samples, traces, costs, costs.draft_ms(mask, int8), proposals, kinds)
        trial.set_user_attr("policy", asdict(pol))
        trial.set_user_attr("acceptance", acc)
        trial.set_user_attr("mean_accepted", mean)
        return sp

    remaining = budget.proxy_trials - len(_done(proxy)) if n_trials is None else n_trials
    if remaining > 0:
        timeout = None if deadline is None else max(1.0, 0.6 * (deadline - time.perf_counter()))
        proxy.optimize(objective, n_trials=remaining, timeout=timeout, callbacks=[progress] if progress else None)
    return Proxy(proxy, samples, proposals, kinds)


def search_cluster(dec, tokenizer, cluster_id: int, texts: list[str], budget: Budget, storage, study_prefix: str,
                   eos: tuple[int, ...], costs: Costs | None = None, warm_start: list[dict] | None = None,
                   progress=None) -> ClusterResult:
    """Search one cluster; rerunning with the same storage and prefix resumes where it stopped."""
    import optuna

    t0 = time.perf_counter()
    deadline = t0 + budget.minutes * 60 if budget.minutes else None
    costs = costs or measure_costs(dec)
    n = dec.n_layers
    stage1 = proxy_stage(dec, tokenizer, cluster_id, texts, budget, storage, study_prefix, eos, costs, warm_start,
                         progress, deadline=deadline)
    proxy, samples, proposals, kinds = stage1.study, stage1.samples, stage1.proposals, stage1.kinds

    # candidates for stage 2: the best pure n-gram policy + the best distinct proxy configurations
    cands: list[tuple[DrafterConfig, float]] = []
    if "ngram" in budget.kinds:
        pol, (sp, _, _) = best_policy(samples, None, costs, 0.0, proposals, ("ngram",))
        cands.append((to_config(pol, None, False), sp))
    ranked = sorted((t for t in proxy.trials if t.value is not None), key=lambda t: -t.value) if kinds else []
    seen = {json.dumps(c.to_dict(), sort_keys=True) for c, _ in cands}
    quota = budget.real_candidates + (1 if "ngram" in budget.kinds else 0)
    for t in ranked:
        if len(cands) >= quota:
            break
        mask = trial_mask(t.params, n)
        p = t.user_attrs["policy"]
        cfg = to_config(Policy(p["kind"], p["max_len"], p["threshold"], p["adaptive"], tuple(p["ngram_sizes"])),
                        mask, t.params["int8"])
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        if key not in seen:
            seen.add(key)
            cands.append((cfg, t.value))

    # stage 2: real timing, interleaved with plain AR prompt by prompt
    real = _study(storage, f"{study_prefix}-c{cluster_id}-real", seed=budget.seed)
    measured = {t.user_attrs["config"]: t for t in _done(real) if "config" in t.user_attrs}
    prompt_ids = [tokenizer(x).input_ids for x in texts[: budget.real_prompts]]
    gen = GenerationConfig(max_new_tokens=budget.max_new_tokens, eos_ids=eos)
    for cfg, proxy_sp in cands:
        key = json.dumps(cfg.to_dict(), sort_keys=True)
        if key in measured or (deadline is not None and time.perf_counter() > deadline):
            continue
        drafter = build(cfg, n, dec.can_skip)
        trial = real.ask()
        trial.set_user_attr("config", key)
        trial.set_user_attr("proxy_speedup", proxy_sp)
        ar_s = sp_s = 0.0
        tokens = drafted = acc = steps = 0
        pruned = False
        for i, ids in enumerate(prompt_ids):
            order = (None, drafter) if i % 2 == 0 else (drafter, None)
            for d in order:
                out, st = generate(dec, ids, d, gen)
                if d is None:
                    ar_s += st.decode_s
                else:
                    sp_s += st.decode_s
                    tokens += len(out)
                    drafted += st.drafted
                    acc += sum(st.accepted)
                    steps += len(st.accepted)
            trial.report(ar_s / sp_s, i)
            if trial.should_prune():
                pruned = True
                break
        trial.set_user_attr("ms_per_token", 1e3 * sp_s / max(1, tokens))
        trial.set_user_attr("ar_ms_per_token", 1e3 * ar_s / max(1, tokens))
        trial.set_user_attr("acceptance", acceptance_rate(acc, drafted))
        trial.set_user_attr("mean_accepted", mean_accepted(acc, steps))
        if pruned:
            real.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            real.tell(trial, ar_s / sp_s)
        measured[key] = real.trials[trial.number]
        if progress:
            progress(real, real.trials[trial.number])

    results = [{**t.user_attrs, "config": json.loads(key), "speedup": t.value}
               for key, t in measured.items() if t.state == optuna.trial.TrialState.COMPLETE]
    best = max(results, key=lambda r: r["speedup"], default=None)
    ar_cfg = DrafterConfig(kind="none").to_dict()
    if best is None or best["speedup"] <= 1.0:
        best = {"config": ar_cfg, "speedup": 1.0, "acceptance": 0.0, "mean_accepted": 1.0,
                "ms_per_token": (best or {}).get("ar_ms_per_token", math.nan),
                "ar_ms_per_token": (best or {}).get("ar_ms_per_token", math.nan), "proxy_speedup": 1.0}
    return ClusterResult(
        cluster=cluster_id, config=best["config"], speedup=best["speedup"], acceptance_rate=best["acceptance"],
        mean_accepted=best["mean_accepted"], ms_per_token=best["ms_per_token"],
        ar_ms_per_token=best["ar_ms_per_token"], proxy_speedup=best["proxy_speedup"],
        proxy_trials=len(_done(proxy)), real_trials=len(_done(real)), search_s=time.perf_counter() - t0,
        candidates=results,
    )


def warm_params(config: dict, n_layers: int) -> dict | None:
    """Stage-1 parameters reproducing a configuration's mask and precision (None for n-gram or AR)."""
    cfg = DrafterConfig.from_dict(config)
    if cfg.kind not in ("layer_skip", "hybrid") or cfg.mask is None:
        return None
    m = SkipMask.from_dict(cfg.mask)
    m.validate(n_layers)
    return trial_params(m, bool(cfg.int8))
