"""The servable model: an MLflow pyfunc whose artifact is a skip bank.

``load_context`` starts the batch that concurrent requests join (``batcher.Batcher``;
``$KNNSSD_BATCH_SIZE`` slots, default auto), whose thread loads the bank and its base model (by the
name the bank records, or ``$KNNSSD_MODEL``); ``predict`` takes a DataFrame with a ``prompt``
column and returns one row per prompt with the generated text and routing/acceptance stats.
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
                                                dtype=os.environ.get("KNNSSD_DTYPE", "auto"))
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
            prompts = _prompts(model_input)
            for text in prompts:
                check_prompt(text)
        except ValueError as e:
            raise MlflowException(str(e), error_code=INVALID_PARAMETER_VALUE) from None
        if self.batcher is not None:
            return pd.DataFrame([r.to_row() for r in self.batcher.generate(prompts, p)])
        return pd.DataFrame([self.generator.generate(text, p).to_row() for text in prompts])


def _prompts(model_input) -> list:
    if isinstance(model_input, dict):
        model_input = pd.DataFrame(model_input)
    if len(model_input) == 0:
        raise ValueError("no prompts: send at least one record with a 'prompt' field")
    if "prompt" not in model_input:
        raise ValueError(f"records need a 'prompt' field; got {sorted(map(str, model_input.columns))}")
    return list(model_input["prompt"])
