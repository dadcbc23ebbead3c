"""search-worker: join the per-cluster Optuna studies of a calibration and add trials to them.

Start it on as many processes or machines as you like with the same parameters as `calibrate`
and a shared storage (a journal file on a shared file system, or an RDB URL); `calibrate` then
finds the trials already done, runs the rest of its budget and the real-timing stage, and
registers one version.
"""
from __future__ import annotations

from pydantic import Field
from prefect import flow

from knnssd.flows.calibrate import CalibrateParams, prepare
from knnssd.tasks.calibration import proxy_trials
from knnssd.tasks.fanout import run_all


class WorkerParams(CalibrateParams):
    trials: int = Field(8, ge=1, description="stage-1 trials this worker adds to each selected cluster's study")
    clusters: list[str] = Field(default_factory=list, description="cluster labels to work on (default: all)")

    def check_clusters(self, labels: set[str]) -> None:
        """Every chosen label is one of ``labels`` (a mistyped one made an idle worker that printed [])."""
        unknown = sorted(set(self.clusters) - labels)
        if unknown:
            raise ValueError(f"--cluster {', '.join(unknown)}: no such cluster here; the clusters are "
                             f"{', '.join(sorted(labels))}")


@flow(name="search-worker", log_prints=True)
def search_worker(params: WorkerParams) -> list[dict]:
    spec, rows, _, clusters, prefix = prepare(params)
    params.check_clusters({c.label for c in clusters})
    chosen = [c for c in clusters if not params.clusters or c.label in params.clusters]
    return run_all(proxy_trials, [(spec, c, rows, params.budget(), params.storage_url(), prefix, params.trials)
                                  for c in chosen])
