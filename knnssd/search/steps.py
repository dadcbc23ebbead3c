"""Calibration steps as plain functions with small, serialisable inputs and outputs.

    load_prompts -> embed -> make_clusters -> search (one call per cluster) -> build_bank -> register

``tasks/`` wraps each in a Prefect task and ``flows/calibrate.py`` chains them; the functions
work without Prefect too (tests, notebooks).
"""
from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from knnssd import locks, models, prompts, tracking
from knnssd.engine.model.exactness import source_digest
from knnssd.routing import bank as banks
from knnssd.routing import pictures, router
from knnssd.search import cancel, optimize
from knnssd.search.budget import Budget
from knnssd.search.costs import Costs, measure_costs
from knnssd.search.study import storage_for
from knnssd.settings import cache_dir, work_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    name: str = models.DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"


_runtime_lock = threading.Lock()


def runtime(spec: ModelSpec):
    """(LoadedModel, decoder) loaded once per process (tasks in threads share it)."""
    with _runtime_lock:
        return _runtime(spec)


@functools.lru_cache(maxsize=2)
def _runtime(spec: ModelSpec):
    lm = models.load(spec.name, spec.dtype, spec.device)
    return lm, lm.decoder


def step_costs(spec: ModelSpec) -> Costs:
    """Step times measured once per process (under the machine lock, like every timing), when a new
    study needs them: a resumed study, and every worker but the first, score with the study's own."""
    with machine_lock():
        return _step_costs(spec)


@functools.lru_cache(maxsize=2)
def _step_costs(spec: ModelSpec) -> Costs:
    return measure_costs(runtime(spec)[1])


eos_ids = models.eos_ids


def code_version() -> str:
    """A hash of the sources a search result depends on (the engine, the search, this module):
    cached results from older code are not reused."""
    package = Path(__file__).parents[1]
    return source_digest(sorted([*(package / "engine").glob("*.py"), *(package / "search").glob("*.py")]))[:16]


def load_prompts(paths: list[str], split: str | None = "calib", fields: prompts.Fields = prompts.Fields(),
                 domain_from_file: bool = False) -> list[prompts.Prompt]:
    """Rows of ``split`` from every file; ids must be unique across files. A row without a domain
    stays unlabelled, or takes its file's stem with ``domain_from_file``."""
    out: list[prompts.Prompt] = []
    seen: dict[str, str] = {}
    for path in paths:
        rows = prompts.load(path, split=split, fields=fields, domain=Path(path).stem if domain_from_file else None)
        for r in rows:
            if r.id in seen:
                raise prompts.PromptError(f"{path}: duplicate id '{r.id}' (also in {seen[r.id]})")
            seen[r.id] = str(path)
        out.extend(rows)
    return out


@torch.inference_mode()
def embed(spec: ModelSpec, rows: list[prompts.Prompt], pooling: router.Pooling = router.Pooling(),
          max_tokens: int = 1024, cache_dir: Path | None = None) -> Path:
    """Prompt vectors (parquet: id, domain, vector), cached by content: a rerun recomputes nothing."""
    from tqdm import tqdm

    lm, dec = runtime(spec)
    pooling.check(dec.n_layers)
    cache_dir = Path(cache_dir or work_dir() / "vectors")
    cache_dir.mkdir(parents=True, exist_ok=True)
    # the fingerprint is the weights' alone: another config, precision or device gives other vectors
    key = router.content_key(lm.fingerprint, lm.config_key, lm.dtype_name, lm.device.type, asdict(pooling), max_tokens,
                             [(r.id, r.domain, r.prompt) for r in rows])
    path = cache_dir / f"vectors-{key}.parquet"
    if path.is_file():
        return path
    vecs = []
    tap = None if pooling.layer < 0 else pooling.layer
    for r in tqdm(rows, desc="embed", file=sys.stderr, mininterval=2):
        ids = lm.tokenizer(r.prompt).input_ids[-max_tokens:] or [0]
        out = dec.forward(torch.tensor(ids, device=lm.device), 0, last=True, tap=tap)
        vecs.append(pooling.pool(out.hidden if out.tapped is None else out.tapped))
    router.save_vectors(path, [r.id for r in rows], [r.domain for r in rows], np.stack(vecs))
    return path


def make_clusters(vectors: Path, k_per_domain: int = 10, n_clusters: int | None = None, labelled: bool = True,
                  seed: int = 0) -> list[router.Cluster]:
    ids, domains, x = router.load_vectors(vectors)
    return router.build_clusters(ids, domains if labelled else [None] * len(ids), x, k_per_domain, n_clusters, seed,
                                 router.center_of(x))


@contextlib.contextmanager
def machine_lock(name: str = "timing"):
    """Serialise timed work on one machine (concurrent searches would disturb each other's clocks). A
    search waiting here stops when its flow is interrupted (``cancel``)."""
    cancel.check()
    with locks.locked(cache_dir() / f"{name}.lock", poll=cancel.check):
        yield


def default_storage() -> str:
    return str(work_dir() / "optuna" / "studies.journal")


def cluster_texts(cluster: router.Cluster, rows: list[prompts.Prompt]) -> list[str]:
    """The cluster's member prompts, round-robin over their domains (a pooled cluster's first
    prompts, which the search samples, then cover every domain)."""
    members = set(cluster.members)
    by_domain: dict[str | None, list[str]] = {}
    for r in rows:
        if r.id in members:
            by_domain.setdefault(r.domain, []).append(r.prompt)
    out, queues = [], list(by_domain.values())
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def search_one(spec: ModelSpec, cluster: router.Cluster, texts: list[str], budget: Budget,
               storage: str, study_prefix: str, warm_start: list[dict] | None = None) -> banks.ClusterResult:
    """Search one cluster (resumable through ``storage``)."""
    from tqdm import tqdm

    lm, dec = runtime(spec)
    with machine_lock():
        bar = tqdm(total=budget.proxy_trials + budget.real_candidates + 1, desc=f"search {cluster.label}",
                   file=sys.stderr, mininterval=2)
        job = optimize.ClusterJob(cluster.id, texts, storage_for(storage), study_prefix, list(warm_start or []))
        model = optimize.SearchModel(dec, lm.tokenizer, eos_ids(lm), lambda: _step_costs(spec))  # the lock is held
        result = optimize.search_cluster(model, job, budget, progress=lambda study, trial: bar.update(1))
        bar.close()
    return result


def proxy_worker(spec: ModelSpec, cluster: router.Cluster, texts: list[str], budget: Budget, storage: str,
                 study_prefix: str, n_trials: int) -> dict:
    """Add exactly ``n_trials`` stage-1 trials to a cluster's study, which other processes or machines
    may be working at the same time (no machine lock: stage-1 trials time nothing)."""
    from tqdm import tqdm

    lm, dec = runtime(spec)
    # the process's one decoder, shared by its clusters' tasks (Prefect runs them on threads): two at once
    # wrote each other's KV cache ("positions up to 128 do not fit the 128 reserved")
    with lm.busy:
        bar = tqdm(total=n_trials, desc=f"worker {cluster.label}", file=sys.stderr, mininterval=2)
        pr = optimize.proxy_stage(optimize.SearchModel(dec, lm.tokenizer, eos_ids(lm), lambda: step_costs(spec)),
                                  optimize.ClusterJob(cluster.id, texts, storage_for(storage), study_prefix), budget,
                                  n_trials=n_trials, progress=lambda s, t: bar.update(1))
        bar.close()
    return {"cluster": cluster.id, "label": cluster.label, "added": n_trials, "study_trials": len(pr.study.trials)}


def build_bank(spec: ModelSpec, clusters: list[router.Cluster], results: list[banks.ClusterResult], vectors: Path,
               pooling: router.Pooling, out_dir: Path, extra: dict | None = None) -> Path:
    """Write the bank folder (bank.json, anchors.parquet, pictures) and return it."""
    lm, dec = runtime(spec)
    ids, domains, x = router.load_vectors(vectors)
    center = router.center_of(x)
    min_sim = router.unmatched_threshold(ids, router.centered(x, center), clusters)
    extra = {**(extra or {}), "device": str(lm.device),
             "exactness": dec.exactness.to_dict() if dec.exactness is not None else None}
    bank = banks.from_clusters(clusters, results, lm.name, lm.fingerprint, dec.n_layers,
                               lm.dtype_name, pooling, min_sim,
                               dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), extra, center)
    banks.validate(bank)
    out_dir = Path(out_dir)
    bank.save(out_dir)
    pictures.draw(bank, router.centered(x, center), domains, out_dir)
    return out_dir


def register(bank_dir: Path, params: dict, uri: str | None = None, alias: str = "candidate") -> dict:
    bank = banks.load(bank_dir)
    metrics = {}
    for c in bank.clusters:
        tag = tracking.metric_tag(c.label)
        metrics[f"speedup_{tag}"] = c.speedup
        metrics[f"acceptance_{tag}"] = c.acceptance_rate
        for key in ("search_s", "margin_over_fixed"):
            if key in c.search:
                metrics[f"{key}_{tag}"] = c.search[key]
    total = sum(c.members for c in bank.clusters)
    metrics["speedup_weighted"] = sum(c.speedup * c.members for c in bank.clusters) / max(1, total)
    reg = tracking.register_bank(bank_dir, bank.model, params, metrics, uri, alias=alias)
    return {"name": reg.name, "version": reg.version, "run_id": reg.run_id, "aliases": reg.aliases, "uri": reg.uri}
