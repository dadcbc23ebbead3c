"""promote: time the candidate against the champion on eval prompts; move `champion` only if the
candidate is not slower beyond a tolerance (and its outputs are identical); log the comparison."""
from __future__ import annotations

from pydantic import BaseModel, Field
from prefect import flow

from knnssd.serving.promote import REPEATS, TOLERANCE
from knnssd.tasks.extend import compare_banks, eval_prompts, fetch_bank, log_and_promote


class PromoteParams(BaseModel):
    model: str = "smollm2"
    candidate: str = Field("candidate", description="alias or version number")
    champion: str = "champion"
    inputs: list[str] = Field(default_factory=list, description="prompt files (default: the five domains' data files)")
    extra_inputs: list[str] = Field(default_factory=list, description="more files (e.g. a new domain's)")
    per_file: int = Field(4, ge=1)
    dtype: str = "auto"
    max_new_tokens: int = Field(64, ge=1)
    tolerance: float = Field(TOLERANCE, ge=0, lt=1, allow_inf_nan=False)
    repeats: int = Field(REPEATS, ge=1, description="runs per prompt and bank; the best time counts")
    tracking_uri: str | None = None


@flow(name="promote", log_prints=True)
def promote(params: PromoteParams = PromoteParams()) -> dict:
    from knnssd.serving.promote import version_uri

    cand = fetch_bank(version_uri(params.model, params.candidate), params.tracking_uri)
    champ = fetch_bank(version_uri(params.model, params.champion), params.tracking_uri)
    if cand["version"] == champ["version"]:
        return {"promote": False, "reason": f"version {cand['version']} already is the champion"}
    rows = eval_prompts(params.inputs, params.per_file, params.extra_inputs)
    comparison = compare_banks(cand, champ, rows, params.dtype, params.max_new_tokens, params.tolerance,
                               params.repeats)
    return log_and_promote(params.model, comparison, params.tracking_uri)
