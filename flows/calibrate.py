"""calibrate: prompts -> anchors -> clusters -> per-cluster search -> a new bank version in MLflow."""
from __future__ import annotations

from pydantic import BaseModel, Field
from prefect import flow

from knnssd import calibration, prompts, router, search
from knnssd.calibration import ModelSpec
from tasks.calibration import (build_bank, cluster_prompts, embed_prompts, load_prompts, register_bank,
                               search_cluster, study_prefix)


class CalibrateParams(BaseModel):
    model: str = "smollm2"
    dtype: str = "auto"
    inputs: list[str] = Field(default_factory=list, description="prompt files; default: the five domains of the data folder")
    domain_from_file: bool = False
    labelled: bool = True
    k_per_domain: int = 10
    n_clusters: int | None = None
    pooling: str = "mean"
    layer: int = -1
    proxy_trials: int = 40
    real_candidates: int = 4
    minutes: float | None = None
    proxy_prompts: int = 8
    real_prompts: int = 4
    max_new_tokens: int = 64
    storage: str | None = None
    tracking_uri: str | None = None
    seed: int = 0
    kinds: list[str] = Field(default_factory=lambda: ["layer_skip", "ngram", "hybrid"],
                             description="drafter kinds searched; plain AR is always a candidate")
    int8: bool = True
    alias: str = Field("candidate", description="alias of the new version (e.g. a baseline's own name)")


@flow(name="calibrate", log_prints=True)
def calibrate(params: CalibrateParams = CalibrateParams()) -> dict:
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
    futures = [search_cluster.submit(spec, c, rows, budget, storage, prefix) for c in clusters]
    results = [f.result() for f in futures]
    bank_dir = build_bank(spec, clusters, results, vectors, pooling, str(calibration.work_dir() / "banks" / prefix),
                          {"inputs": paths, "study_prefix": prefix, "storage": storage})
    return register_bank(bank_dir, params.model_dump(), params.tracking_uri, params.alias)


if __name__ == "__main__":
    calibrate()
