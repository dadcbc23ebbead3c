"""generate: a prompt file -> routed speculative generation -> a parquet file, summary in MLflow; with
``request.shards`` over 1, the file cut into shards, each a flow run of its own on a work pool's workers."""
from __future__ import annotations

from prefect import flow

from knnssd.serving.prepare import pin_version, prepared
from knnssd.serving.request import GenerateRequest
from knnssd.tasks import shards as sharded
from knnssd.tasks.generation import generate_batch, log_summary

POOL = "knnssd-process"


@flow(name="generate", log_prints=True)
def generate(request: GenerateRequest, pool: str = POOL, worker_wait_s: float = 600.0) -> dict:
    """One ``GenerateRequest``: its prompts, routed and generated into its output (resumable), the summary
    logged to MLflow. Under `knnssd generate` the CLI's prepared job is taken; a deployment's run
    prepares here: every check once, before any model loads, holding the output's lock to the end.
    With ``request.shards`` over 1, each shard runs on ``pool`` (``tasks.shards``), and this run waits
    for them (a worker ``worker_wait_s`` at most) and joins them. A shard's own run (``request.shard``)
    logs nothing: its parent logs the file's one MLflow run."""
    if request.sharded:
        return _sharded(pin_version(request), pool, worker_wait_s)
    with prepared(request):
        summary = generate_batch(request)
        run_id = log_summary(summary, request) if request.shard is None else None
    return summary.report(run_id)


def _sharded(request: GenerateRequest, pool: str, worker_wait_s: float) -> dict:
    with prepared(request) as job:  # the final output: checked once, its lock held until it is written
        plan = sharded.plan(job)
        deployment = sharded.ensure_deployment(pool)
        sharded.wait_for_worker(pool, worker_wait_s)
        plan = sharded.watch(deployment, plan)
        summary = sharded.join(job, plan)
        run_id = sharded.log_summary(summary, job, plan)
    return summary.report(run_id)
