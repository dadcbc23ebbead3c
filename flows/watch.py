"""watch-drop-folder (scheduled): new domain files in the drop folder, or enough unmatched prompts,
-> add-domain for each -> promote the result. Each input is processed once (a state file records it),
and a version added by a run stopped before its promotion ended is promoted by the next run."""
from __future__ import annotations

from pydantic import BaseModel, Field, field_validator
from prefect import flow, get_run_logger

from knnssd.flows.add_domain import AddDomainParams, add_domain
from knnssd.flows.promote import PromoteParams, promote
from knnssd.routing.bank import BankError
from knnssd.search.extend import check_name
from knnssd.serving.promote import version_uri
from knnssd.tasks.extend import fetch_bank, mark_done, mark_promoted, pending_inputs, unpromoted


class WatchParams(BaseModel):
    drop: str = Field(description="folder where new domain files (jsonl/parquet/csv) are dropped")
    model: str = "smollm2"
    state: str | None = Field(None, description="record of processed inputs (default <drop>/.knnssd-processed.json)")
    min_prompts: int = Field(20, ge=1, description="a new domain needs at least this many prompts")
    use_unmatched: bool = True
    dtype: str = "auto"
    search: dict = Field(default_factory=dict, description="add-domain settings (proxy_trials, k_per_domain, ...)")
    promote: dict = Field(default_factory=dict, description="promote settings (per_file, tolerance, inputs, ...)")
    tracking_uri: str | None = None

    def state_path(self) -> str:
        return self.state or f"{self.drop.rstrip('/')}/.knnssd-processed.json"

    @field_validator("search")
    @classmethod
    def _search(cls, search: dict) -> dict:
        _check_keys(search, AddDomainParams, OWN_SEARCH, "add-domain")
        AddDomainParams(name="check", inputs=[], **search).budget()  # each value, as add-domain will take it
        return search

    @field_validator("promote")
    @classmethod
    def _promote(cls, promote: dict) -> dict:
        _check_keys(promote, PromoteParams, OWN_PROMOTE, "promote")
        PromoteParams(**promote)
        return promote


# what watch sets itself in each flow's parameters (an unknown key was once ignored unsaid)
OWN_SEARCH = {"name", "inputs", "model", "model_uri", "dtype", "tracking_uri"}
OWN_PROMOTE = {"model", "candidate", "dtype", "tracking_uri", "extra_inputs"}


def _check_keys(given: dict, params: type[BaseModel], own: set[str], what: str) -> None:
    takes = set(params.model_fields) - own
    wrong = sorted(set(given) - takes)
    if wrong:
        why = "set by watch" if set(wrong) <= own else "unknown"
        raise ValueError(f"{what} setting(s) {', '.join(wrong)}: {why}; it takes {', '.join(sorted(takes))}")


@flow(name="watch-drop-folder", log_prints=True)
def watch(params: WatchParams) -> dict:
    state = params.state_path()
    items = pending_inputs(params.drop, state, params.model, params.min_prompts, params.use_unmatched)
    waiting = unpromoted(state)  # added by a run that was stopped before its promotion ended
    if not items and waiting is None:
        return {"added": [], "skipped": [], "promotion": None}
    added, skipped, base_uri = [], [], waiting and waiting["uri"]
    # a file named after a domain the bank holds would fail add-domain after the model loads, on every run
    taken = fetch_bank(base_uri or version_uri(params.model, "champion"), params.tracking_uri)["domains"]
    for it in items:
        try:
            check_name(taken, it["name"])
        except BankError as e:
            get_run_logger().warning("skipping %s: %s (rename the file to add it as another domain)", it["path"], e)
            skipped.append(it["path"])
            continue
        taken.append(it["name"])
        reg = add_domain(AddDomainParams(name=it["name"], inputs=[it["path"]], model=params.model, model_uri=base_uri,
                                         dtype=params.dtype, tracking_uri=params.tracking_uri, **params.search))
        mark_done(state, [it], reg)
        added.append({"name": it["name"], **reg})
        base_uri = reg["uri"]  # the next domain extends this version
    waiting = unpromoted(state)
    if waiting is None:
        return {"added": [], "skipped": skipped, "promotion": None}
    result = promote(PromoteParams(model=params.model, candidate=waiting["version"], dtype=params.dtype,
                                   tracking_uri=params.tracking_uri, extra_inputs=waiting["inputs"], **params.promote))
    mark_promoted(state)
    return {"added": added, "skipped": skipped, "promotion": result}
