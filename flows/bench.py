"""bench: every method side by side on eval streams and out-of-domain sets -> JSON, markdown, PNGs, an MLflow run."""
from __future__ import annotations

from prefect import flow

from knnssd.bench.bank import BenchConfig
from knnssd.tasks.bench import run_bench


@flow(name="bench", log_prints=True)
def bench(cfg: BenchConfig) -> dict:
    return run_bench(cfg)
