"""The servable model: an MLflow pyfunc whose artifact is a skip bank.

``load_context`` checks the server's settings (``server_settings``: ``$KNNSSD_BATCH_SIZE`` slots,
default auto; ``$KNNSSD_MODEL``, default the name the bank records; ``$KNNSSD_DTYPE``, ``$KNNSSD_DEVICE``
and ``$KNNSSD_GRAPHS``, default auto), then starts the batch that concurrent requests join
(``batcher.Batcher``), whose thread loads the bank and its base model. Under ``mlflow models serve`` a
setting that cannot be used ends the server with one line and exit status 2, before the model loads
where it can. ``predict`` takes a DataFrame with a ``prompt`` column and returns one row per prompt with
the generated text and routing/acceptance stats, every value valid JSON (``None``, never NaN).
"""
from __future__ import annotations

import os
import sys

import mlflow.pyfunc
import pandas as pd


def server_settings(env) -> dict:
    """The ``KNNSSD_*`` settings of ``env``, each checked in one line by the rules of the CLI's options
    (``--dtype``, ``--device``, ``--batch-size``); an empty value means its default."""
    from knnssd.engine.spec.request_params import batch_size
    from knnssd.models import DTYPES, resolve_device
    from knnssd.settings import graphs

    dtype = env.get("KNNSSD_DTYPE") or "auto"
    if dtype not in DTYPES:
        raise ValueError(f"KNNSSD_DTYPE={dtype!r} is not one of {', '.join(DTYPES)}")
    device = env.get("KNNSSD_DEVICE") or "auto"
    try:
        dev = resolve_device(device)
    except ValueError as e:
        raise ValueError(f"KNNSSD_DEVICE: {e}") from None
    graphs(dev, env.get("KNNSSD_GRAPHS") or "auto")
    return {"model": env.get("KNNSSD_MODEL") or None, "dtype": dtype, "device": device,
            "slots": batch_size(env.get("KNNSSD_BATCH_SIZE") or "auto", "KNNSSD_BATCH_SIZE")}


class KnnSsdModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        if "__pyfunc_model_path__" in os.environ:  # under ``mlflow models serve`` (see ``_refuse``)
            from knnssd.processes import end_with_parent

            end_with_parent("the model server")
        try:
            self._load(context, server_settings(os.environ))
        except ValueError as e:  # a setting, model or bank that cannot be used (every one-line error is one)
            _refuse(e)

    def _load(self, context, settings: dict) -> None:
        from knnssd.serving.batcher import Batcher

        batcher = Batcher.routed(context.artifacts["bank"], settings["model"], settings["dtype"], settings["device"],
                                 settings["slots"], "KNNSSD_BATCH_SIZE")
        self.generator = batcher.gen
        self.batcher = batcher if batcher.batching else None

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

        from knnssd.engine.spec.request_params import GenerateParams, check_prompt

        try:  # a bad request is answered 400 with the reason in "message", before any generation
            p = GenerateParams.from_dict(params or {})
            self.generator.lm.limits.check(p)
            prompts = _prompts(model_input)
            for text in prompts:
                check_prompt(text)
        except ValueError as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from None
        if self.batcher is not None:
            _admit_concurrent_requests(self.batcher.plan.slots)
            return frame(self.batcher.generate(prompts, p))
        return frame([self.generator.generate(text, p) for text in prompts])


def frame(results) -> pd.DataFrame:
    """The answer's rows, as Python objects: pandas would turn a ``None`` cluster among integers into a
    float NaN (and the integers into floats), which MLflow writes as the invalid JSON token ``NaN``."""
    return pd.DataFrame([r.to_row() for r in results], dtype=object)


def _refuse(error: ValueError) -> None:
    """Under ``mlflow models serve`` (the scoring server names the model in ``__pyfunc_model_path__``),
    say why in one line and end the server with status 2: raised, it would print the import's whole
    traceback (100-147 lines) through uvicorn. Anywhere else (a script's ``load_model``), raise it."""
    if "__pyfunc_model_path__" not in os.environ:
        raise error
    print(f"knnssd: error: {error}", file=sys.stderr, flush=True)
    os._exit(2)


def _admit_concurrent_requests(slots: int) -> None:
    """Let as many requests run ``predict`` at once as the batch has slots. ``mlflow models serve``
    (uvicorn) runs each request's ``predict`` with ``asyncio.to_thread``: on its event loop's default
    executor, a ``ThreadPoolExecutor`` of min(32, cores + 4) threads, 6 on a 2-core machine. No more
    than 6 requests could then be in the batch together, the rest queued behind them. The server loads the model before its loop
    runs, so the loop's executor cannot be replaced at load; instead, where ``predict`` runs on a
    ``ThreadPoolExecutor``'s worker thread, that executor may start up to ``slots`` threads (each
    ``predict`` thread only waits for its results). Elsewhere (a script calling ``predict``), nothing."""
    from knnssd.shims import widen_this_executor

    widen_this_executor(slots)


def _prompts(model_input) -> list:
    if isinstance(model_input, dict):
        model_input = pd.DataFrame(model_input)
    if len(model_input) == 0:
        raise ValueError("no prompts: send at least one record with a 'prompt' field")
    if "prompt" not in model_input:
        raise ValueError(f"records need a 'prompt' field; got {sorted(map(str, model_input.columns))}")
    return list(model_input["prompt"])
