"""Generation tasks: generate (resumable), then log the summary to MLflow, each on one ``GenerateRequest``
(prepared once by its flow or the CLI: ``serving.prepare``)."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from knnssd import tracking
from knnssd.serving import batch
from knnssd.serving.request import GenerateRequest
from knnssd.tasks.retry import transient


@task(retries=1, retry_condition_fn=transient, retry_delay_seconds=5, cache_policy=NO_CACHE)
def generate_batch(request: GenerateRequest) -> batch.Summary:
    """A retry resumes: ids already in the output (or its progress journal) are skipped."""
    return batch.run(request)


@task(retries=2, retry_condition_fn=transient, retry_delay_seconds=3, cache_policy=NO_CACHE)
def log_summary(summary: batch.Summary, request: GenerateRequest) -> str:
    return tracking.log_run("knnssd-generation", {"model_uri": request.model_uri, "input": request.input,
                                                  **request.params.__dict__},
                            summary.metrics(), [summary.unmatched_log], request.tracking_uri, run_name="generate")
