"""v(R): what one full-model pass over R rows costs, measured on this machine (``PassCosts``): the price every
draft-length rule weighs a draft against (``draft_lengths.choose_lengths`` for a batch, ``draft_policy.Goodput``
for one sequence)."""
from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from knnssd.engine.model.attention import PREFILL_ROWS
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.packed import forward_slots
from knnssd.engine.model.timing import median_ms


@dataclass(frozen=True)
class PassCosts:
    """v(R): seconds of one packed full-model pass over R rows, measured at a few row counts and
    interpolated linearly between them (extrapolated past the last)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, rows: int) -> float:
        r, s = self.rows, self.seconds
        i = bisect.bisect_left(r, rows)
        if i < len(r) and r[i] == rows:
            return s[i]
        lo, hi = (max(0, min(i - 1, len(r) - 2)), max(1, min(i, len(r) - 1)))
        slope = (s[hi] - s[lo]) / (r[hi] - r[lo])
        return max(s[0], s[lo] + slope * (rows - r[lo]))

    def joined(self, other: "PassCosts") -> "PassCosts":
        """Both sets of measurements, by row count (``self``'s where both have one)."""
        both = dict(sorted({**dict(zip(other.rows, other.seconds)), **dict(zip(self.rows, self.seconds))}.items()))
        return PassCosts(tuple(both), tuple(both.values()))

    def describe(self) -> str:
        return ", ".join(f"v({r})={1e3 * s:.1f} ms" for r, s in zip(self.rows, self.seconds))


def measure_pass_costs(decoder: Decoder, slots: int, per_seq: tuple[int, ...] = (1, 2, 4, 8, 12),
                       context: int = 64, repeats: int = 3, pooled: bool = False) -> PassCosts:
    """Time packed passes of ``slots`` sequences with t rows each (R = slots * t), after ``context``
    positions, on slots of their own (the decoder's caches are not touched); ``pooled``: with the
    slots' caches in one ``SlotPool`` and attention batched over them."""
    out = []
    for t, run in packed_passes(decoder, slots, per_seq, context, pooled):
        out.append((slots * t, median_ms(run, decoder.device, repeats) / 1e3))
    return PassCosts(tuple(r for r, _ in out), tuple(s for _, s in out))


def packed_passes(decoder: Decoder, slots: int, per_seq: tuple[int, ...], context: int, pooled: bool
                   ) -> list[tuple[int, Callable[[], object]]]:
    """(t, a packed pass of t rows per slot) for each t in ``per_seq``, over ``slots`` new slots that hold
    the same ``context`` random tokens."""
    ss, pool = decoder.pooled_slots(slots) if pooled else ([decoder.slot() for _ in range(slots)], None)
    vocab = decoder.stack.embed.shape[0]
    g = torch.Generator().manual_seed(0)
    top = max(per_seq)
    ids = torch.randint(0, vocab, (context + top,), generator=g).to(decoder.device)
    for s in ss:
        s.reserve(context + top)
    ss[0].forward(ids[:context], 0)
    for s in ss[1:]:  # the same K/V: copied, not computed again
        s.cache.copy_from(ss[0].cache, context)
    return [(t, lambda calls=[(ids[context : context + t], context)] * slots: forward_slots(ss, calls, pool))
            for t in sorted(set(per_seq))]


_SEQUENCE: "weakref.WeakKeyDictionary[Decoder, PassCosts]" = weakref.WeakKeyDictionary()


def sequence_costs(decoder) -> PassCosts | None:
    """v(R) of one sequence's verify pass on ``decoder``, for R up to the rows its probe covered (the median of 5
    after one), measured at its first call (about 2 s) and kept while the decoder lives; None for a decoder
    without slots of its own to time on (the HF fallback, the static step). Made non-decreasing in R: a pass of
    more rows never costs less, so a timing that says it does is noise, and a rule would draft longer for it."""
    if not decoder.can_batch:
        return None
    if decoder not in _SEQUENCE:  # or ``price_sequences`` gave them
        max_t = min(decoder.exactness.max_t if decoder.exactness is not None else PREFILL_ROWS, PREFILL_ROWS)
        c = measure_pass_costs(decoder, 1, tuple(range(1, max_t + 1)), repeats=5)
        seconds = [max(c.seconds[: i + 1]) for i in range(len(c.seconds))]
        _SEQUENCE[decoder] = PassCosts(c.rows, tuple(seconds))
    return _SEQUENCE[decoder]


def price_sequences(decoder: Decoder, costs: PassCosts) -> None:
    """Have ``sequence_costs`` give ``costs`` for ``decoder`` instead of measuring (a test's known prices)."""
    _SEQUENCE[decoder] = costs
