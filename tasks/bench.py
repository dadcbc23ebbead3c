"""Benchmark task: one long, resumable measurement (its journal lets a retry continue)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from knnssd.bench import bank as bench
from knnssd.tasks.retry import transient


@task(retries=1, retry_condition_fn=transient, retry_delay_seconds=5, cache_policy=NO_CACHE)
def run_bench(cfg: bench.BenchConfig) -> dict:
    report = bench.run(cfg)
    return {"out": str(cfg.out), "targets": report["targets"], "mlflow_run_id": report.get("mlflow_run_id")}
