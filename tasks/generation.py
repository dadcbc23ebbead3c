"""Generation tasks: read prompts, generate (resumable), log the summary to MLflow."""
from __future__ import annotations

import functools

from prefect import task
from prefect.cache_policies import NO_CACHE

from knnssd import prompts, tracking
from knnssd.engine.params import GenerateParams
from knnssd.serving import batch
from knnssd.serving.routed import RoutedGenerator
from knnssd.tasks.retry import transient


@functools.lru_cache(maxsize=2)
def _generator(model_uri: str, dtype: str, tracking_uri: str | None, device: str) -> RoutedGenerator:
    return RoutedGenerator.from_model_uri(model_uri, dtype=dtype, device=device, tracking_uri=tracking_uri)


@task(retries=2, retry_condition_fn=transient, retry_delay_seconds=2, cache_policy=NO_CACHE)
def read_prompts(path: str, split: str | None) -> list[prompts.Prompt]:
    rows = prompts.load(path, split=split)
    batch.check(rows)
    return rows


@task(retries=1, retry_condition_fn=transient, retry_delay_seconds=5, cache_policy=NO_CACHE)
def generate_batch(model_uri: str, rows: list[prompts.Prompt], output: str, params: GenerateParams, dtype: str,
                   overwrite: bool, tracking_uri: str | None, batch_size: int | None = None,
                   device: str = "auto", input_path: str | None = None) -> batch.Summary:
    """A retry resumes: ids already in the output (or its progress journal) are skipped. ``input_path``:
    the file ``rows`` came from, which ``output`` must not be."""
    return batch.run(_generator(model_uri, dtype, tracking_uri, device), rows, output, params, overwrite,
                     batch_size=batch_size, inputs=[input_path] if input_path else [])


@task(retries=2, retry_condition_fn=transient, retry_delay_seconds=3, cache_policy=NO_CACHE)
def log_summary(summary: batch.Summary, model_uri: str, input_path: str, params: GenerateParams,
                tracking_uri: str | None) -> str:
    return tracking.log_run("knnssd-generation", {"model_uri": model_uri, "input": input_path, **params.__dict__},
                            summary.metrics(), [summary.unmatched_log], tracking_uri, run_name="generate")
