"""The servable model: an MLflow pyfunc whose artifact is a skip bank.

``load_context`` loads the bank and its base model (by the name the bank records, or
``$KNNSSD_MODEL``); ``predict`` takes a DataFrame with a ``prompt`` column and returns one row
per prompt with the generated text and routing/acceptance stats.
"""
from __future__ import annotations

from pathlib import Path

import mlflow.pyfunc
import pandas as pd

from . import __version__


MODEL_CODE = Path(__file__).with_name("pyfunc_model.py")


def pip_requirements() -> list[str]:
    return [f"knnssd=={__version__}"]


class KnnSsdModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context):
        import os

        from .engine import RoutedGenerator

        self.generator = RoutedGenerator.from_bank_dir(
            context.artifacts["bank"], model=os.environ.get("KNNSSD_MODEL"), dtype=os.environ.get("KNNSSD_DTYPE", "auto"))

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        from .engine import GenerateParams

        if isinstance(model_input, dict):
            model_input = pd.DataFrame(model_input)
        if "prompt" not in model_input:
            raise ValueError("input needs a 'prompt' column")
        p = GenerateParams.from_dict(params or {})
        rows = [self.generator.generate(str(text), p).to_row() for text in model_input["prompt"]]
        return pd.DataFrame(rows)
