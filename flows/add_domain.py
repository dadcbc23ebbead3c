"""add-domain: a base bank version + a new domain's prompts -> a new version holding old + new clusters.

Only the new clusters are searched, warm-started from the nearest old clusters' configurations;
the base version is only read.
"""
from __future__ import annotations

from pydantic import Field
from prefect import flow

from knnssd.flows.params import SearchParams
from knnssd.search.steps import ModelSpec
from knnssd.settings import work_dir
from knnssd.tasks.calibration import embed_prompts, register_bank, search_cluster, study_prefix
from knnssd.tasks.extend import fetch_bank, merge_bank, new_clusters, new_domain_rows, warm_starts
from knnssd.tasks.fanout import run_all


class AddDomainParams(SearchParams):
    name: str = Field(min_length=1, pattern=r"\S", description="the new domain's name (a cluster label)")
    inputs: list[str] = Field(description="prompt files of the new domain (calib rows, or the first 2/3 without a split)")
    model_uri: str | None = Field(None, description="base version (default models:/knnssd-<model>@champion)")
    warm: int = Field(3, ge=0, description="nearest old clusters to warm-start from (0: cold search)")


@flow(name="add-domain", log_prints=True)
def add_domain(params: AddDomainParams) -> dict:
    from knnssd.serving.promote import version_uri

    base_uri = params.model_uri or version_uri(params.model, "champion")
    base = fetch_bank(base_uri, params.tracking_uri)
    spec = ModelSpec(base["model"], params.dtype, params.device)
    calib, _ = new_domain_rows(params.inputs, params.name)
    vectors = embed_prompts(spec, calib, base["pooling"])
    clusters = new_clusters(base["dir"], vectors, params.name, params.k_per_domain, params.seed)
    budget = params.budget()
    prefix = f"{study_prefix(spec, vectors, clusters, budget)}-{'warm' if params.warm else 'cold'}"
    storage = params.storage_url()
    results = run_all(search_cluster, [
        (spec, c, calib, budget, storage, prefix, warm_starts(base["dir"], c, params.warm)) for c in clusters])
    out = merge_bank(base["dir"], clusters, results, vectors, str(work_dir() / "banks" / prefix),
                     f"{base_uri} (version {base['version']})")
    return register_bank(out, {**params.model_dump(), "base_version": base["version"]}, params.tracking_uri)
