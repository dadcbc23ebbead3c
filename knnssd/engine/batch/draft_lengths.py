"""How many tokens each sequence of a batch drafts at a step: the goodput rule (``choose_lengths``), over
measured pass costs (``pass_costs.PassCosts``) and each sequence's drafting so far (``DraftModel``).

Terms:
    s_b(j)     sequence b's chance that the first j tokens of a draft are all accepted, given that it
               drafted j or more: its steps that accepted j or more over those that drafted j or more
               (``DecodeStats.accepted_at``, ``drafted_at``), shrunk towards the same for the sequences
               with the same kind of drafter. Measured by draft position, not as one per-token rate:
               acceptance comes in runs (an n-gram hit is accepted for several tokens or not at all; a
               confident layer-skip draft mostly is), which a per-token rate a^j would miss
               A token tree's j counts its nodes: s_b(j) is its steps that accepted j or more over those
               that drafted j or more nodes, so a tree's E_b(k) is what k nodes emitted
    d_b        its draft seconds per draft call, shrunk in the same way (``DraftModel``). Per call, not
               per token: an n-gram hit drafts many tokens for almost nothing, a layer-skip draft costs a pass per
               token until its confidence drops, and a hybrid does one or the other
    v(R)       seconds of one packed pass over R rows (``PassCosts``, measured)
    E_b(k)     expected tokens sequence b emits with a k-token draft: 1 + s_b(1) + ... + s_b(k)
    goodput    sum_b E_b(k_b) / (v(sum_b (1 + k_b)) + sum_{b: k_b > 0} d_b)
"""
from __future__ import annotations

from dataclasses import dataclass, field


from knnssd.engine.spec.loop import Run
from knnssd.engine.spec.draft_policy import add_at, count_at
from knnssd.engine.model.pass_costs import PassCosts

EXPLORE = 16  # a sequence the rule has not let draft for EXPLORE steps per active sequence drafts once, and
# is measured again (figures that once said "not worth it" would otherwise never change)


def choose_lengths(caps: list[int], survival: list[list[float]], draft_s: list[float], costs: PassCosts) -> list[int]:
    """Draft lengths k_b <= caps[b] that maximise the step's goodput (module docstring; ``survival[b][j - 1]``
    is s_b(j), non-increasing in j). First the rows: one drafted token at a time where it raises E / v
    most, until none does. Then the calls: while dropping a sequence's whole draft (and its call's d_b)
    raises goodput, the draft whose dropping raises it most is dropped. All zeros (plain batched
    decoding) when no draft pays for its rows and its call."""
    n = len(caps)
    k = [0] * n
    emitted = float(n)
    best = emitted / costs(n)
    while True:
        rows = n + sum(k)
        choice, choice_rate = None, best
        for b, cap in enumerate(caps):
            if k[b] < cap:
                rate = (emitted + survival[b][k[b]]) / costs(rows + 1)  # E_b(k + 1) - E_b(k) more tokens
                if rate > choice_rate:
                    choice, choice_rate = b, rate
        if choice is None:
            break
        emitted += survival[choice][k[choice]]
        k[choice] += 1
        best = choice_rate
    gain = [sum(survival[b][: k[b]]) for b in range(n)]  # E_b(k_b) - 1
    calls = sum(draft_s[b] for b in range(n) if k[b])
    while True:
        rows = n + sum(k)
        drop, drop_rate = None, emitted / (costs(rows) + calls)
        for b in range(n):
            if k[b]:
                rate = (emitted - gain[b]) / (costs(rows - k[b]) + calls - draft_s[b])
                if rate > drop_rate:
                    drop, drop_rate = b, rate
        if drop is None:
            return k
        emitted -= gain[drop]
        calls -= draft_s[drop]
        k[drop] = 0


@dataclass
class _Drafts:
    """A set of sequences' drafting, pooled: seconds and calls, and per draft position j (index j - 1)
    the steps that drafted j or more and that accepted j or more."""

    seconds: float = 0.0
    calls: int = 0
    tried: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)

    def add(self, run: Run) -> None:
        s = run.stats
        self.seconds += s.draft_s
        self.calls += s.draft_calls
        add_at(self.tried, s.drafted_at)
        add_at(self.kept, s.accepted_at)


class DraftModel:
    """s_b and d_b for ``choose_lengths``: each sequence's own measurements shrunk towards its kind's
    (the sequences with the same kind of drafter, finished and active, pooled), and its kind's towards
    d = 0 and s(j) = 1/2^j, each as if PRIOR steps of the prior came first: d_b = (own seconds + PRIOR
    d_kind) / (own calls + PRIOR), and per draft position s_b(j) = (own accepted j+ + PRIOR s_kind(j)) /
    (own drafted j+ + PRIOR). A joining sequence is costed at its kind's figures: without them it looks
    free to draft, and a slow drafter (an int8 layer-skip draft costs about half a one-sequence step per
    token) drafts its longest draft while the whole batch waits. One or two steps (an unlucky call, a
    rejected draft) do not set a sequence's figures on their own."""

    PRIOR = 4

    def __init__(self):
        self._done: dict[str, _Drafts] = {}  # kind -> the finished sequences' drafting

    @staticmethod
    def _kind(run: Run) -> str:
        return type(run.drafter).__name__ + (" tree" if run.trees else "")  # a tree's s(j) is by node

    def finished(self, run: Run) -> None:
        if run.drafter is not None:
            self._done.setdefault(self._kind(run), _Drafts()).add(run)

    def __call__(self, runs: list[Run], caps: list[int]) -> tuple[list[list[float]], list[float]]:
        """(s_b(1..caps[b]) for each run, d_b for each run)."""
        kinds: dict[str, _Drafts] = {}
        for kind, d in self._done.items():
            kinds[kind] = _Drafts(d.seconds, d.calls, list(d.tried), list(d.kept))
        for r in runs:
            if r.drafter is not None:
                kinds.setdefault(self._kind(r), _Drafts()).add(r)
        p = self.PRIOR
        survival, seconds = [], []
        for r, cap in zip(runs, caps):
            kind = kinds.get(self._kind(r)) if r.drafter is not None else None
            kind = kind or _Drafts()
            s = r.stats
            d_kind = kind.seconds / (kind.calls + p)  # shrunk towards 0
            seconds.append((s.draft_s + p * d_kind) / (s.draft_calls + p))
            curve, last = [], 1.0
            for j in range(cap):
                s_kind = (count_at(kind.kept, j) + p * 0.5 ** (j + 1)) / (count_at(kind.tried, j) + p)  # towards 1/2^j
                last = min(last, (count_at(s.accepted_at, j) + p * s_kind) / (count_at(s.drafted_at, j) + p))
                curve.append(last)
            survival.append(curve)
        return survival, seconds
