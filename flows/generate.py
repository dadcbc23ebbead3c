"""generate: a prompt file -> routed speculative generation -> a parquet file, summary in MLflow."""
from __future__ import annotations

from prefect import flow

from knnssd.serving.request import GenerateRequest
from knnssd.tasks.generation import generate_batch, log_summary, read_prompts


@flow(name="generate", log_prints=True)
def generate(request: GenerateRequest) -> dict:
    """One ``GenerateRequest``: its prompts, routed and generated into its output (resumable), the summary
    logged to MLflow."""
    request.output_path()  # before any task: an output that is the input is never written
    read_prompts(request)  # the prompts, read and checked once a process: a bad file fails before the model loads
    summary = generate_batch(request)
    run_id = log_summary(summary, request)
    return summary.report(run_id)
