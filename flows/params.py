"""Flow parameters shared by the calibration-type flows (validated by Prefect through pydantic).

The search settings are not declared here: ``BudgetParams`` is made from ``search/budget.py``'s
``Budget`` (names, types, defaults, help), as the CLI options are (``cli.options.budget_args``).
"""
from __future__ import annotations

import dataclasses

from pydantic import Field, create_model

from knnssd.search import steps
from knnssd.search.budget import Budget, settings


def _budget_fields() -> dict:
    out = {}
    for st in settings():
        kind, default = st.kind, st.default
        if isinstance(default, tuple):  # JSON has no tuples: a list in flow parameters
            kind, default = list[str], list(default)
        out[st.name] = (kind, Field(default, description=st.help))
    return out


BudgetParams = create_model("BudgetParams", **_budget_fields())


class SearchParams(BudgetParams):
    """The model and the per-cluster search budget."""

    model: str = "smollm2"
    dtype: str = "auto"
    device: str = Field("auto", description="auto (the GPU where CUDA has one), cpu or cuda[:N]")
    k_per_domain: int = Field(10, ge=1, description="anchors (clusters) per labelled domain")
    storage: str | None = Field(None, description="Optuna storage: journal file path or URL (default artifacts/optuna)")
    tracking_uri: str | None = None

    def budget(self) -> Budget:
        return Budget(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Budget)})

    def storage_url(self) -> str:
        return self.storage or steps.default_storage()
