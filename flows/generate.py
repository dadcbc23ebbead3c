"""generate: a prompt file -> routed speculative generation -> a parquet file, summary in MLflow."""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from knnssd.serving.batch import check_paths
from knnssd.serving.request import GenerateRequest
from knnssd.tasks.generation import generate_batch, log_summary, read_prompts


@flow(name="generate", log_prints=True)
def generate(request: GenerateRequest) -> dict:
    """One ``GenerateRequest``: its prompts, routed and generated into its output (resumable), the summary
    logged to MLflow."""
    check_paths(Path(request.output), [request.input])  # before any task: an output that is the input is never written
    rows = read_prompts(request)
    summary = generate_batch(request, rows)
    run_id = log_summary(summary, request)
    return summary.report(run_id)
