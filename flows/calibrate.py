"""calibrate: prompts -> anchors -> clusters -> per-cluster search -> a new bank version in MLflow."""
from __future__ import annotations

from pydantic import Field
from prefect import flow

from knnssd import prompts
from knnssd.flows.params import SearchParams
from knnssd.routing import router
from knnssd.search.steps import ModelSpec
from knnssd.settings import work_dir
from knnssd.tasks.calibration import (build_bank, cluster_prompts, embed_prompts, load_prompts, register_bank,
                               search_cluster, study_prefix)
from knnssd.tasks.fanout import run_all


class CalibrateParams(SearchParams):
    inputs: list[str] = Field(default_factory=list, description="prompt files; default: the five domains of the data folder")
    domain_from_file: bool = False
    labelled: bool = True
    n_clusters: int | None = Field(None, ge=1)
    pooling: str = "mean"
    layer: int = -1
    alias: str = Field("candidate", description="alias of the new version (e.g. a baseline's own name)")

    def paths(self) -> list[str]:
        return self.inputs or prompts.domain_files()


def prepare(params: CalibrateParams):
    """The steps every calibration-type flow shares: prompts -> vectors -> clusters -> study prefix."""
    spec = ModelSpec(params.model, params.dtype, params.device)
    rows = load_prompts(params.paths(), "calib", params.domain_from_file)
    vectors = embed_prompts(spec, rows, router.Pooling(params.pooling, params.layer))
    clusters = cluster_prompts(vectors, params.k_per_domain, params.n_clusters, params.labelled, params.seed)
    return spec, rows, vectors, clusters, study_prefix(spec, vectors, clusters, params.budget())


@flow(name="calibrate", log_prints=True)
def calibrate(params: CalibrateParams = CalibrateParams()) -> dict:
    spec, rows, vectors, clusters, prefix = prepare(params)
    storage = params.storage_url()
    results = run_all(search_cluster, [(spec, c, rows, params.budget(), storage, prefix) for c in clusters])
    bank_dir = build_bank(spec, clusters, results, vectors, router.Pooling(params.pooling, params.layer),
                          str(work_dir() / "banks" / prefix),
                          {"inputs": params.paths(), "study_prefix": prefix, "storage": storage})
    return register_bank(bank_dir, params.model_dump(), params.tracking_uri, params.alias)


if __name__ == "__main__":
    calibrate()
