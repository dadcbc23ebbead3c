"""generate: a prompt file -> routed speculative generation -> a parquet file, summary in MLflow."""
from __future__ import annotations

from prefect import flow

from knnssd.serving.prepare import prepared
from knnssd.serving.request import GenerateRequest
from knnssd.tasks.generation import generate_batch, log_summary


@flow(name="generate", log_prints=True)
def generate(request: GenerateRequest) -> dict:
    """One ``GenerateRequest``: its prompts, routed and generated into its output (resumable), the summary
    logged to MLflow. Under `knnssd generate` the CLI's prepared job is taken; a deployment's run
    prepares here: every check once, before any model loads, holding the output's lock to the end."""
    with prepared(request):
        summary = generate_batch(request)
        run_id = log_summary(summary, request)
    return summary.report(run_id)
