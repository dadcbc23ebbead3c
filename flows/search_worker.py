"""search-worker: join the per-cluster Optuna studies of a calibration and add trials to them.

Start it on as many processes or machines as you like with the same parameters as `calibrate`
and a shared storage (a journal file on a shared file system, or an RDB URL); `calibrate` then
finds the trials already done, runs the rest of its budget and the real-timing stage, and
registers one version.
"""
from __future__ import annotations

from pydantic import Field
from prefect import flow

from flows.calibrate import CalibrateParams
from knnssd import calibration, prompts, router, search
from knnssd.calibration import ModelSpec
from tasks.calibration import cluster_prompts, embed_prompts, load_prompts, proxy_trials, study_prefix


class WorkerParams(CalibrateParams):
    trials: int = Field(8, description="stage-1 trials this worker adds to each selected cluster's study")
    clusters: list[str] = Field(default_factory=list, description="cluster labels to work on (default: all)")


@flow(name="search-worker", log_prints=True)
def search_worker(params: WorkerParams) -> list[dict]:
    spec = ModelSpec(params.model, params.dtype)
    paths = params.inputs or [str(prompts.default_data_dir() / f"{d}.jsonl") for d in prompts.DOMAINS]
    pooling = router.Pooling(params.pooling, params.layer)
    budget = search.Budget(params.proxy_trials, params.real_candidates, params.minutes, params.proxy_prompts,
                           params.real_prompts, params.max_new_tokens, seed=params.seed,
                           kinds=tuple(params.kinds), int8=params.int8)
    storage = params.storage or calibration.default_storage()
    rows = load_prompts(paths, "calib", params.domain_from_file)
    vectors = embed_prompts(spec, rows, pooling)
    clusters = cluster_prompts(vectors, params.k_per_domain, params.n_clusters, params.labelled, params.seed)
    prefix = study_prefix(spec, vectors, clusters, budget)
    chosen = [c for c in clusters if not params.clusters or c.label in params.clusters]
    futures = [proxy_trials.submit(spec, c, rows, budget, storage, prefix, params.trials) for c in chosen]
    return [f.result() for f in futures]
