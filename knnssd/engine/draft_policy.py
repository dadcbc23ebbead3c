"""The draft policy: one definition for the decoding loop (``decode.Run`` and the drafters) and the
search's simulator (``search.proxy.simulate``), so that what the search predicts is what decoding does.

Terms:
    k          the policy's current draft length (a drafter's ``max_len``, adapted after each step)
    left       tokens the sequence may still emit, counting the step's own next token
    probed     the longest draft the exactness probe covered (its ``max_t`` - 1)
    threshold  a layer-skip draft stops after its first token whose probability is under it
"""
from __future__ import annotations

from collections.abc import Iterable


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
