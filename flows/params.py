"""Flow parameters shared by the calibration-type flows (validated by Prefect through pydantic)."""
from __future__ import annotations

from pydantic import BaseModel, Field

from knnssd.search import calibration, optimize


class SearchParams(BaseModel):
    """The model and the per-cluster search budget."""

    model: str = "smollm2"
    dtype: str = "auto"
    k_per_domain: int = 10
    proxy_trials: int = 40
    real_candidates: int = 4
    minutes: float | None = None
    proxy_prompts: int = 8
    real_prompts: int = 4
    max_new_tokens: int = 64
    storage: str | None = Field(None, description="Optuna storage: journal file path or URL (default artifacts/optuna)")
    tracking_uri: str | None = None
    seed: int = 0
    kinds: list[str] = Field(default_factory=lambda: ["layer_skip", "ngram", "hybrid"],
                             description="drafter kinds searched; plain AR is always a candidate")
    int8: bool = True

    def budget(self) -> optimize.Budget:
        return optimize.Budget(self.proxy_trials, self.real_candidates, self.minutes, self.proxy_prompts,
                             self.real_prompts, self.max_new_tokens, seed=self.seed, kinds=tuple(self.kinds),
                             int8=self.int8)

    def storage_url(self) -> str:
        return self.storage or calibration.default_storage()
