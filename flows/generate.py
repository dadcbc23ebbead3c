"""generate: a prompt file -> routed speculative generation -> a parquet file, summary in MLflow."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from prefect import flow

from knnssd.engine.params import GenerateParams
from knnssd.serving.batch import check_paths
from knnssd.tasks.generation import generate_batch, log_summary, read_prompts


@flow(name="generate", log_prints=True)
def generate(model_uri: str, input: str, output: str, params: GenerateParams = GenerateParams(), split: str | None = None,
             dtype: str = "auto", overwrite: bool = False, tracking_uri: str | None = None,
             batch_size: int | None = None, device: str = "auto") -> dict:
    """``batch_size``: sequences decoded together (None: auto; 1: one at a time); ``device``: auto (the GPU
    where CUDA has one), cpu or cuda[:N]."""
    check_paths(Path(output), [input])  # before any task: an output that is the input is never written
    rows = read_prompts(input, split)
    summary = generate_batch(model_uri, rows, output, params, dtype, overwrite, tracking_uri, batch_size, device,
                             input_path=input)
    run_id = log_summary(summary, model_uri, input, params, tracking_uri)
    return {**asdict(summary), "mlflow_run_id": run_id}


if __name__ == "__main__":
    import sys

    generate(*sys.argv[1:4])
