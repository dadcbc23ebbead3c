"""The search settings, declared once: ``Budget``, what one cluster's search may spend and on what.

The flow parameters (``flows/params.py``) and the CLI options (``cli.options.budget_args``) are made from
these fields (name, type, default, help, flag); ``prefect.yaml`` restates none of them. No heavy
imports here: the CLI builds its options from this module before anything loads.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field


def setting(default, help: str, flag: str | None = None):
    """A search setting: its default, help text and command-line flag (default ``--<name-with-dashes>``)."""
    meta = {"help": help, "flag": flag}
    if isinstance(default, tuple):
        return field(default_factory=lambda: default, metadata=meta)
    return field(default=default, metadata=meta)


# The drafter kinds a search may take (``engine.spec.drafters.KINDS`` but "none": plain decoding always is a
# candidate). suffix policies are not searched by default (on the embedded model they measured no faster than
# n-gram lookup, docs/benchmarks.md), but wherever a lookup kind is, the fixed suffix drafter is timed and may
# be taken (``objective.choose``).
SEARCHED = ("layer_skip", "ngram", "hybrid", "suffix")


@dataclass
class Budget:
    """What one cluster's search may spend, and on what."""

    proxy_trials: int = setting(40, "stage-1 (proxy) trials per cluster", "--trials")
    real_candidates: int = setting(4, "configurations timed for real per cluster, besides plain AR", "--candidates")
    minutes: float | None = setting(None, "wall-clock cap per cluster search")
    proxy_prompts: int = setting(8, "calib prompts per cluster traced in stage 1")
    real_prompts: int = setting(4, "calib prompts per cluster timed in stage 2")
    max_new_tokens: int = setting(64, "tokens generated per prompt while searching")
    context: int = setting(192, "prompt tokens kept in teacher-forced passes")
    seed: int = setting(0, "sampler seed")
    kinds: tuple[str, ...] = setting(("layer_skip", "ngram", "hybrid"), "drafter kinds searched, of "
                                     + ", ".join(SEARCHED) + "; plain AR always is")
    int8: bool = setting(True, "int8 draft weights allowed (--no-int8: full precision only, the paper's layer skipping)",
                         "--no-int8")

    def __post_init__(self):
        unknown = set(self.kinds) - set(SEARCHED)
        if unknown or not self.kinds:
            raise ValueError(f"unknown drafter kinds {sorted(unknown)}; choose from {', '.join(SEARCHED)}")
        self.kinds = tuple(self.kinds)
        for st in settings():  # one line each, naming the option a user typed
            v = getattr(self, st.name)
            if st.name == "minutes":
                if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                          and v > 0):
                    raise ValueError(f"{st.flag} must be a number of minutes > 0, got {v!r}")
            elif st.name == "seed":  # what Optuna's and numpy's samplers take
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
                    raise ValueError(f"{st.flag} must be an integer in [0, 2**32), got {v!r}")
            elif st.kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{st.flag} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class Setting:
    """One ``Budget`` field, as the flow parameters and the CLI options are made from it."""

    name: str
    kind: object  # its type
    default: object
    help: str
    flag: str  # the command-line option


def settings() -> list[Setting]:
    hints = typing.get_type_hints(Budget)
    out = []
    for f in dataclasses.fields(Budget):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(Setting(f.name, hints[f.name], default, f.metadata["help"],
                           f.metadata["flag"] or "--" + f.name.replace("_", "-")))
    return out
