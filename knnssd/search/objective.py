"""What a cluster's search maximises, in one place: the proxy value of a stage-1 trial, the measured
speedup of a stage-2 candidate, and the choice among the measured ones (``optimize`` runs the stages).

- **proxy** (``proxy_value``): a trial's skip mask and draft precision give teacher-forced traces over
  the cluster's samples; the best drafting policy on them (``proxy.best_policy``, which replays the
  loop with ``engine.spec.draft_policy``'s rules and measured step costs) predicts the decode speedup, the
  trial's value.
- **measured** (``measure``): a candidate's decode-only time against plain decoding's, prompt by
  prompt, alternating which goes first so both see the same drift of the machine; speedup = plain
  time / candidate time, reported after each prompt so that a hopeless candidate is pruned.
- **choice** (``choose``): the fastest measured candidate, but a tuned one only where it beats the best
  fixed drafter (``drafters.FIXED``, untuned, always measured) by more than the timing's noise, and plain
  decoding (speedup 1.0) where none is faster: no cluster is slower than plain decoding as measured, and
  none takes a tuned configuration that its own measurements cannot tell from a fixed one.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

from knnssd.engine.spec.loop import GenerationConfig, acceptance_rate, generate, mean_accepted
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.spec.drafters import Drafter, DrafterConfig, fixed_kind
from knnssd.search import cancel
from knnssd.search.costs import Costs
from knnssd.search.proxy import LOOKUPS, Sample, best_policy, trace
from knnssd.search.study import trial_mask


def proxy_value(trial, dec: Decoder, samples: list[Sample], space: dict, context: int, costs: Costs,
                proposals: dict, kinds: tuple[str, ...]) -> float:
    """A stage-1 trial's value: the predicted speedup of the best policy for the mask and precision it
    suggests; the policy and its acceptance are kept on the trial."""
    params = {name: trial.suggest_categorical(name, choices) for name, choices in space.items()}
    mask, int8 = trial_mask(params, dec.n_layers), params["int8"]
    traces = trace(dec, samples, mask, int8, context)
    pol, (speedup, acc, mean) = best_policy(samples, traces, costs, costs.draft_ms(mask, int8), proposals, kinds)
    trial.set_user_attr("policy", asdict(pol))
    trial.set_user_attr("acceptance", acc)
    trial.set_user_attr("mean_accepted", mean)
    return speedup


@dataclass
class Measured:
    """A candidate's timing against plain decoding over the prompts it ran (all, unless ``pruned``)."""

    plain_s: float = 0.0
    draft_s: float = 0.0  # the candidate's decode-only seconds
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    pruned: bool = False

    @property
    def speedup(self) -> float:
        return self.plain_s / self.draft_s

    def attrs(self) -> dict:
        """What a stage-2 trial keeps besides its value."""
        return {"ms_per_token": 1e3 * self.draft_s / max(1, self.tokens),
                "ar_ms_per_token": 1e3 * self.plain_s / max(1, self.tokens),
                "acceptance": acceptance_rate(self.accepted, self.drafted),
                "mean_accepted": mean_accepted(self.accepted, self.steps)}


def measure(dec: Decoder, drafter: Drafter, prompt_ids: list[list[int]], gen: GenerationConfig,
            report: Callable[[float, int], bool], stop: Callable[[], None] = cancel.check) -> Measured:
    """Time ``drafter`` against plain decoding on each prompt, alternating which goes first. After each
    prompt, ``report(speedup so far, prompt index)`` returns True to prune; ``stop`` is called before each
    prompt (it raises to abandon the measurement)."""
    m = Measured()
    for i, ids in enumerate(prompt_ids):
        stop()
        for d in (None, drafter) if i % 2 == 0 else (drafter, None):
            out, st = generate(dec, ids, d, gen)
            if d is None:
                m.plain_s += st.decode_s
            else:
                m.draft_s += st.decode_s
                m.tokens += len(out)
                m.drafted += st.drafted
                m.accepted += sum(st.accepted)
                m.steps += len(st.accepted)
        if report(m.speedup, i):
            m.pruned = True
            break
    return m


def timing_noise(results: list[dict]) -> float:
    """The relative spread (standard deviation / mean) of plain decoding's ms per token over the measured
    candidates: each timed plain decoding on the same prompts beside itself, so these differ only by the
    machine's noise. 0.0 with fewer than three."""
    plain = [r["ar_ms_per_token"] for r in results if math.isfinite(r.get("ar_ms_per_token", math.nan))]
    return statistics.stdev(plain) / statistics.mean(plain) if len(plain) >= 3 else 0.0


def takes_fixed(kinds: tuple[str, ...]) -> bool:
    """Whether a search of ``kinds`` times and may take the fixed drafters: where it may draft by lookup at all
    (``--kinds layer_skip`` makes a bank of masks, the paper's method, and stays one)."""
    return any(k in LOOKUPS for k in kinds)


def worth_timing(predicted: float, fixed_predicted: float | None, noise: float) -> bool:
    """Whether a tuned candidate is worth its real timing: its predicted speedup (the simulator's) beats the best
    predicted for the fixed drafters (None: none is timed) by more than the timing's noise. ``choose`` would not
    take it for less, so a cluster whose candidates cannot beat the fixed drafters stops its search there."""
    return fixed_predicted is None or predicted > fixed_predicted * (1 + noise)


def choose(results: list[dict], kinds: tuple[str, ...] | None = None) -> dict:
    """The chosen candidate (``config``, ``speedup`` and its ``Measured.attrs``) among those of ``kinds`` and
    the fixed drafters where ``takes_fixed(kinds)`` (None: any), with ``best_fixed_speedup`` (the fastest
    fixed drafter's; NaN: none measured) and ``timing_noise`` added.

    The fastest, unless it is tuned and beats the best fixed drafter it may take by less than twice the
    noise (a speedup is a ratio of two timings, and two speedups are compared): then that fixed drafter,
    which holds on any prompt. Plain decoding where the choice is not faster than 1.0."""
    noise = timing_noise(results)
    speed = lambda r: r["speedup"]  # noqa: E731
    fixed_all = [r for r in results if fixed_kind(r["config"])]
    allowed = [r for r in results if kinds is None or r["config"].get("kind") in kinds
               or (fixed_kind(r["config"]) and takes_fixed(kinds))]
    fixed = max((r for r in allowed if fixed_kind(r["config"])), key=speed, default=None)
    best = max(allowed, key=speed, default=None)
    if best is not None and fixed is not None and best["speedup"] < fixed["speedup"] * (1 + 2 * noise):
        best = fixed
    if best is None or best["speedup"] <= 1.0:
        plain_ms = (best or {}).get("ar_ms_per_token", math.nan)
        best = {"config": DrafterConfig(kind="none").to_dict(), "speedup": 1.0, "acceptance": 0.0,
                "mean_accepted": 1.0, "ms_per_token": plain_ms, "ar_ms_per_token": plain_ms, "proxy_speedup": 1.0}
    top = max(fixed_all, key=speed, default=None)
    return {**best, "best_fixed_speedup": top["speedup"] if top else math.nan, "timing_noise": noise}
