"""The draft policy: one definition for the decoding loop (``loop.Run`` and the drafters) and the
search's simulator (``search.proxy.simulate``), so that what the search predicts is what decoding does.

Terms:
    k          the policy's current draft length (a drafter's ``max_len``, adapted after each step)
    left       tokens the sequence may still emit, counting the step's own next token
    probed     the longest draft the exactness probe covered (its ``max_t`` - 1)
    threshold  a layer-skip draft stops after its first token whose probability is under it
    goodput    a lookup draft is cut to the length that emits the most tokens per second at the measured
               pass costs, from how such drafts fared before (``Goodput``; 0: a plain step)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


def cap(k: int, left: int, probed: int) -> int:
    """The longest draft a step may have: the policy's length, what could still be emitted besides the
    step's own next token (a longer draft could never be), and what the probe covered."""
    return max(0, min(k, left - 1, probed))


def confident(confidences: Iterable[float], threshold: float) -> int:
    """How many of a layer-skip draft's tokens it keeps: up to and including the first under ``threshold``."""
    n = 0
    for n, c in enumerate(confidences, 1):
        if stops(c, threshold):
            return n
    return n


def stops(confidence, threshold: float):
    """Does a layer-skip draft stop after a token of this ``confidence`` (a float, or a tensor on the device)?"""
    return confidence < threshold


def hybrid_uses_ngram(proposal: list[int]) -> bool:
    """A hybrid drafts by n-gram lookup where the lookup found a continuation, else with the skipped layers."""
    return len(proposal) > 0


def adapt_length(k: int, max_len: int, drafted: int, accepted: int) -> int:
    """HF's schedule (``candidate_generator.py``): +2 after a fully accepted draft, else -1, within 1..max_len."""
    if not drafted:
        return k
    return min(max_len, k + 2) if accepted == drafted else max(1, k - 1)


def next_len(k: int, max_len: int, adaptive: bool, drafted: int, accepted: int) -> int:
    """The next step's draft length after one that drafted ``drafted`` tokens and accepted ``accepted``."""
    return adapt_length(k, max_len, drafted, accepted) if adaptive else k


def add_at(counts: list[int], more: list[int]) -> None:
    """Add ``more`` to ``counts`` position by position (``DecodeStats.drafted_at``, ``accepted_at``, ``Goodput``'s
    counts), longer where ``more`` is."""
    counts.extend([0] * (len(more) - len(counts)))
    for j, c in enumerate(more):
        counts[j] += c


def count_at(counts: list[int], j: int) -> int:
    """``counts[j]``, 0 past its end (position counts grow only as far as some step reached)."""
    return counts[j] if j < len(counts) else 0


PRIOR = 4  # a goodput state's counts weigh as if PRIOR steps of the figures they are shrunk towards came first


def goodput_state(offered: int, last: tuple[int, int] | None) -> tuple[int, int]:
    """What a lookup draft's acceptance is kept by (``Goodput``): how long the draft on offer is (up to 2, 3 to
    5, 6 and more: a lookup that continues further found a surer match) and how the sequence's last draft on
    offer fared, as far as its step showed (``verified``: 0, none yet; 1, a token was rejected; 2, none was).
    ``last``: that step's (reached, accepted). Acceptance comes in runs, and both predict it: replayed over 2,410
    lookup steps of 48 eval prompts, learnt on half and scored on the other half, the previous step's outcome
    took a goodput cut from 1.31x to 1.50x (n-gram) and with the length from 1.34x to 1.55-1.64x (suffix)
    (docs/benchmarks.md, "goodput lengths").
    """
    bucket = 0 if offered <= 2 else 1 if offered <= 5 else 2
    if last is None:
        return bucket, 0
    reached, accepted = last
    return bucket, 2 if accepted == reached else 1


def verified(offered: list[int], kept: int, emitted: list[int]) -> tuple[int, int]:
    """(reached, accepted): how far into a draft ``offered`` a step that verified its first ``kept`` tokens and
    emitted ``emitted`` (the accepted ones and the next) shows whether the draft's tokens would be accepted,
    and how many of those were. A rejection ends it; a cut draft whose ``kept`` tokens were all accepted shows
    one more, as the next token is the model's own for that position (greedy: its argmax; sampled: drawn from
    its distribution, so it equals the drafted token with the probability a drafted point mass is accepted)."""
    a = len(emitted) - 1
    if a < kept or kept >= len(offered):
        return min(a + 1, len(offered)), a
    return a + 1, a + (emitted[a] == offered[a])


class Goodput:
    """Draft lengths by goodput, for one sequence at a time: of a lookup draft of L tokens on offer, keep the k
    (0..L) that maximises E(k) / v(1 + k), the tokens a step emits per second, where E(k) = 1 + s(1) + ... + s(k),
    s(j) the chance that the first j drafted tokens are all accepted in this step's state (``goodput_state``),
    and v(R) the measured seconds of a verify pass of R rows (``pass_costs.sequence_costs``). A lookup is left
    out of the price: it takes about 0.1 ms beside a pass's 15-25 ms. k = 0 is a plain decoding step.

    s(j) is the product of h(1..j), h(i) the chance that token i is accepted once tokens 1..i-1 were: a cut
    draft still shows whether its next token would have been (``verified``), so a state whose drafts stopped
    paying keeps being measured by its plain steps, and drafts again when they would pay. Each state's h(i)
    is shrunk towards all states' (``PRIOR``), and those towards 1/2.

    The counts are this object's: one per drafter, shared by the sequences it drafts for, as a bank's cluster
    shares its drafter. ``loop.Run`` applies it, and the search's simulator (``search.proxy.simulate``) too,
    so what the search predicts for a goodput drafter is what decoding does. A batch's draft lengths have their
    own rule over the same v(R) (``draft_lengths.choose_lengths``: every sequence's rows in one pass)."""

    def __init__(self):
        # state -> [i - 1]: the steps that showed whether token i would be accepted, and those where it was
        self.reached: dict[tuple[int, int], list[int]] = {}
        self.accepted: dict[tuple[int, int], list[int]] = {}
        self.all_reached: list[int] = []
        self.all_accepted: list[int] = []

    def survival(self, state: tuple[int, int], n: int) -> list[float]:
        """s(1..n) in ``state``."""
        reached, accepted = self.reached.get(state, []), self.accepted.get(state, [])
        out, s = [], 1.0
        for i in range(n):
            pooled = (count_at(self.all_accepted, i) + PRIOR * 0.5) / (count_at(self.all_reached, i) + PRIOR)
            s *= (count_at(accepted, i) + PRIOR * pooled) / (count_at(reached, i) + PRIOR)
            out.append(s)
        return out

    def length(self, state: tuple[int, int], offered: int, cost: Callable[[int], float]) -> int:
        """The k in 0..``offered`` with the most tokens per unit of ``cost(rows)`` (v: seconds, or ms)."""
        best_k, best = 0, 1.0 / cost(1)
        emitted = 1.0
        for k, s in enumerate(self.survival(state, offered), 1):
            emitted += s
            rate = emitted / cost(1 + k)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def observe(self, state: tuple[int, int], offered: list[int], kept: int, emitted: list[int]) -> None:
        """A step in ``state`` verified the first ``kept`` tokens of the draft ``offered`` and emitted
        ``emitted``."""
        reached, accepted = verified(offered, kept, emitted)
        for counts in (self.reached.setdefault(state, []), self.all_reached):
            add_at(counts, [1] * reached)
        for counts in (self.accepted.setdefault(state, []), self.all_accepted):
            add_at(counts, [1] * accepted)
