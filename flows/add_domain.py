"""add-domain: a base bank version + a new domain's prompts -> a new version holding old + new clusters.

Only the new clusters are searched, warm-started from the nearest old clusters' configurations;
the base version is only read.
"""
from __future__ import annotations

from pydantic import BaseModel, Field
from prefect import flow

from knnssd import calibration, search
from knnssd.calibration import ModelSpec
from tasks.calibration import embed_prompts, register_bank, search_cluster, study_prefix
from tasks.extend import fetch_bank, merge_bank, new_clusters, new_domain_rows, warm_starts


class AddDomainParams(BaseModel):
    name: str = Field(description="the new domain's name (a cluster label)")
    inputs: list[str] = Field(description="prompt files of the new domain (calib rows, or the first 2/3 without a split)")
    model: str = "smollm2"
    model_uri: str | None = Field(None, description="base version (default models:/knnssd-<model>@champion)")
    dtype: str = "auto"
    k_per_domain: int = 10
    warm: int = Field(3, description="nearest old clusters to warm-start from (0: cold search)")
    proxy_trials: int = 40
    real_candidates: int = 4
    minutes: float | None = None
    proxy_prompts: int = 8
    real_prompts: int = 4
    max_new_tokens: int = 64
    storage: str | None = None
    tracking_uri: str | None = None
    seed: int = 0
    kinds: list[str] = Field(default_factory=lambda: ["layer_skip", "ngram", "hybrid"])
    int8: bool = True


@flow(name="add-domain", log_prints=True)
def add_domain(params: AddDomainParams) -> dict:
    from knnssd.promote import version_uri

    base_uri = params.model_uri or version_uri(params.model, "champion")
    base = fetch_bank(base_uri, params.tracking_uri)
    spec = ModelSpec(base["model"], params.dtype)
    calib, _ = new_domain_rows(params.inputs, params.name)
    vectors = embed_prompts(spec, calib, base["pooling"])
    clusters = new_clusters(base["dir"], vectors, params.name, params.k_per_domain, params.seed)
    budget = search.Budget(params.proxy_trials, params.real_candidates, params.minutes, params.proxy_prompts,
                           params.real_prompts, params.max_new_tokens, seed=params.seed, kinds=tuple(params.kinds),
                           int8=params.int8)
    prefix = f"{study_prefix(spec, vectors, clusters, budget)}-{'warm' if params.warm else 'cold'}"
    storage = params.storage or calibration.default_storage()
    futures = [search_cluster.submit(spec, c, calib, budget, storage, prefix, warm_starts(base["dir"], c, params.warm))
               for c in clusters]
    results = [f.result() for f in futures]
    out = merge_bank(base["dir"], clusters, results, vectors, str(calibration.work_dir() / "banks" / prefix),
                     f"{base_uri} (version {base['version']})")
    return register_bank(out, {**params.model_dump(), "base_version": base["version"]}, params.tracking_uri)
