"""The servable model: an MLflow pyfunc whose artifact is a skip bank.

``load_context`` starts the batch that concurrent requests join (``batcher.Batcher``;
``$KNNSSD_BATCH_SIZE`` slots, default auto), whose thread loads the bank and its base model (by the
name the bank records, or ``$KNNSSD_MODEL``; in ``$KNNSSD_DTYPE`` and on ``$KNNSSD_DEVICE``, default auto);
``predict`` takes a DataFrame with a ``prompt`` column and returns one row per prompt with the generated
text and routing/acceptance stats.
"""
from __future__ import annotations

import mlflow.pyfunc
import pandas as pd


class KnnSsdModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import os

        from knnssd.serving.routed import RoutedGenerator

        from knnssd.engine.batched import auto_slots
        from knnssd.engine.params import GenerateParams
        from knnssd.serving.batcher import Batcher

        def load():  # on the batch's thread (``Batcher``)
            gen = RoutedGenerator.from_bank_dir(context.artifacts["bank"], model=os.environ.get("KNNSSD_MODEL"),
                                                dtype=os.environ.get("KNNSSD_DTYPE") or "auto",
                                                device=os.environ.get("KNNSSD_DEVICE") or "auto")
            if not gen.can_batch:
                return gen, None
            size = os.environ.get("KNNSSD_BATCH_SIZE", "auto")
            d = GenerateParams()
            slots = (auto_slots(gen.decoder, d.max_prompt_tokens + d.max_new_tokens, 1 << 10) if size == "auto"
                     else int(size))
            return gen, gen.plan(slots, d.max_prompt_tokens + d.max_new_tokens) if slots > 1 else None

        batcher = Batcher(load)
        self.generator = batcher.gen
        self.batcher = batcher if batcher.batching else None

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

        from knnssd.engine.params import GenerateParams, check_prompt

        try:  # a bad request is answered 400 with the reason in "message", before any generation
            p = GenerateParams.from_dict(params or {})
            self.generator.lm.limits.check(p)
            self.generator.lm.limits.check(p)
            prompts = _prompts(model_input)
            for text in prompts:
                check_prompt(text)
        except ValueError as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from None
        if self.batcher is not None:
            _admit_concurrent_requests(self.batcher.plan.slots)
            return pd.DataFrame([r.to_row() for r in self.batcher.generate(prompts, p)])
        return pd.DataFrame([self.generator.generate(text, p).to_row() for text in prompts])


def _admit_concurrent_requests(slots: int) -> None:
    """Let as many requests run ``predict`` at once as the batch has slots. ``mlflow models serve``
    (uvicorn) runs each request's ``predict`` with ``asyncio.to_thread``: on its event loop's default
    executor, a ``ThreadPoolExecutor`` of min(32, cores + 4) threads, 6 on a 2-core machine. No more
    than 6 requests could then be in the batch together, the rest queued behind them (16 concurrent
    requests took 7.8 s instead of 6.8 on a 2-core Zen 4). The server loads the model before its loop
    runs, so the loop's executor cannot be replaced at load; instead, where ``predict`` runs on a
    ``ThreadPoolExecutor``'s worker thread, that executor may start up to ``slots`` threads (each
    ``predict`` thread only waits for its results). Elsewhere (a script calling ``predict``), nothing."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_worker" and "executor_reference" in frame.f_locals):
        frame = frame.f_back
    executor = frame.f_locals["executor_reference"]() if frame is not None else None
    if isinstance(executor, ThreadPoolExecutor) and getattr(executor, "_max_workers", slots) < slots:
        executor._max_workers = slots


def _prompts(model_input) -> list:
    if isinstance(model_input, dict):
        model_input = pd.DataFrame(model_input)
    if len(model_input) == 0:
        raise ValueError("no prompts: send at least one record with a 'prompt' field")
    if "prompt" not in model_input:
        raise ValueError(f"records need a 'prompt' field; got {sorted(map(str, model_input.columns))}")
    return list(model_input["prompt"])
