"""Calibration tasks: retries for transient failures, caching where a step is deterministic."""
from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import INPUTS, NO_CACHE, TASK_SOURCE, CacheKeyFnPolicy

from knnssd.prompts import Prompt
from knnssd.routing import router
from knnssd.routing.bank import ClusterResult
from knnssd.search import steps
from knnssd.search.budget import Budget
from knnssd.search.steps import ModelSpec
from knnssd.tasks.retry import transient


@task(retries=2, retry_condition_fn=transient, retry_delay_seconds=2, cache_policy=NO_CACHE)
def load_prompts(paths: list[str], split: str = "calib", domain_from_file: bool = False) -> list[Prompt]:
    return steps.load_prompts(paths, split, domain_from_file=domain_from_file)


@task(retries=1, retry_condition_fn=transient, cache_policy=NO_CACHE)  # cached on disk by content hash (a rerun recomputes nothing)
def embed_prompts(spec: ModelSpec, rows: list[Prompt], pooling: router.Pooling) -> str:
    return str(steps.embed(spec, rows, pooling))


# a finished search is reused only by the same inputs *and* the same search code
SEARCH_CACHE = INPUTS + TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=lambda ctx, params: steps.code_version())


@task(cache_policy=NO_CACHE)  # cheap; recomputed so clustering changes always apply
def cluster_prompts(vectors: str, k_per_domain: int, n_clusters: int | None, labelled: bool, seed: int
                    ) -> list[router.Cluster]:
    return steps.make_clusters(Path(vectors), k_per_domain, n_clusters, labelled, seed)


@task(retries=1, retry_condition_fn=transient, retry_delay_seconds=5, cache_policy=SEARCH_CACHE, task_run_name="search-{cluster.label}")
def search_cluster(spec: ModelSpec, cluster: router.Cluster, rows: list[Prompt], budget: Budget, storage: str,
                   study_prefix: str, warm_start: list[dict] | None = None) -> ClusterResult:
    """A retry (or a rerun after a kill) resumes the cluster's Optuna studies from ``storage``."""
    texts = steps.cluster_texts(cluster, rows)
    return steps.search_one(spec, cluster, texts, budget, storage, study_prefix, warm_start)


@task(retries=1, retry_condition_fn=transient, retry_delay_seconds=5, cache_policy=NO_CACHE, task_run_name="proxy-worker-{cluster.label}")
def proxy_trials(spec: ModelSpec, cluster: router.Cluster, rows: list[Prompt], budget: Budget, storage: str,
                 study_prefix: str, n_trials: int) -> dict:
    """Scale-out: add ``n_trials`` stage-1 trials to the cluster's shared study."""
    return steps.proxy_worker(spec, cluster, steps.cluster_texts(cluster, rows), budget, storage,
                                    study_prefix, n_trials)


@task(cache_policy=NO_CACHE)
def build_bank(spec: ModelSpec, clusters: list[router.Cluster], results: list[ClusterResult], vectors: str,
               pooling: router.Pooling, out_dir: str, extra: dict) -> str:
    return str(steps.build_bank(spec, clusters, results, Path(vectors), pooling, Path(out_dir), extra))


@task(retries=2, retry_condition_fn=transient, retry_delay_seconds=3, cache_policy=NO_CACHE)
def register_bank(bank_dir: str, params: dict, tracking_uri: str | None, alias: str = "candidate") -> dict:
    return steps.register(Path(bank_dir), params, tracking_uri, alias)


@task(cache_policy=NO_CACHE)
def study_prefix(spec: ModelSpec, vectors: str, clusters: list[router.Cluster], budget: Budget) -> str:
    """A name that is the same on a rerun with the same inputs, so searches resume."""
    lm, _ = steps.runtime(spec)
    key = router.content_key(lm.fingerprint, spec.dtype, Path(vectors).name, [(c.label, c.members) for c in clusters],
                             budget.__dict__)
    return f"{lm.name}-{key[:12]}"
