"""Batched speculative decoding: several sequences advance together, one full-model pass per step.

Each sequence runs in its own slot of the decoder (``Decoder.slot``: the same weights, a KV cache of
its own) with its own drafter. A step:

    k_b   = choose_lengths(...)                   # draft lengths from goodput, down to 0
    call_b = run_b.propose(k_b)                   # each sequence drafts on its slot
    logits = forward_slots(slots, calls, pool)    # one pass: every sequence's rows packed together
    run_b.apply(verdict_b)                        # verify on the device (run_b.judge), read every verdict
                                                  # in one host copy, emit, roll back (decode.Run)

The slots' caches are rows of one ``SlotPool``, so attention runs batched: one call per key
length over the slots reading it (``pooled_exact`` checks on the real model that this gives each
sequence its own pass's rows, bitwise; where not, attention runs per sequence, as before).

A finished sequence's slot takes the next job at once (its prefill runs on the slot; while other
sequences are active, at most one prefill per step, so none of them waits longer than one
prefill). A prompt whose leading tokens equal those of a prompt in the batch, or of one whose slot
has taken no other job since it finished, copies their K/V instead of computing them (``Prefixes``,
where ``prefix_exact`` measures that exact). Where the linears are row-invariant up to the packed row
count (``rows_exact``), every sequence's tokens equal its own plain decoding's, as in the one-sequence
loop.

Terms:
    s_b(j)     sequence b's chance that the first j tokens of a draft are all accepted, given that it
               drafted j or more: its steps that accepted j or more over those that drafted j or more
               (``DecodeStats.accepted_at``, ``drafted_at``), shrunk towards the same for the sequences
               with the same kind of drafter. Measured by draft position, not as one per-token rate:
               acceptance comes in runs (an n-gram hit is accepted for several tokens or not at all; a
               confident layer-skip draft mostly is), which a per-token rate a^j would miss
    d_b        its draft seconds per draft call, shrunk in the same way (``DraftModel``). Per call, not
               per token: an n-gram hit drafts 10 tokens in 0.1 ms, a layer-skip draft costs a pass per
               token until its confidence drops, and a hybrid does one or the other
    v(R)       seconds of one packed pass over R rows (``PassCosts``, measured)
    E_b(k)     expected tokens sequence b emits with a k-token draft: 1 + s_b(1) + ... + s_b(k)
    goodput    sum_b E_b(k_b) / (v(sum_b (1 + k_b)) + sum_{b: k_b > 0} d_b)
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from knnssd.engine import exactness
from knnssd.engine.attention import CAUSAL_BLOCK, PREFILL_ROWS
from knnssd.engine.cache import BUCKET, SPAN, KVCache
from knnssd.engine.decode import (DecodeStats, GenerationConfig, Prefill, Reused, Run, add_at, prefill, reusable,
                                  reuse_unit_of)
from knnssd.engine.drafters import Drafter
from knnssd.engine.params import KV_MEMORY, too_many_slots
from knnssd.engine.sampling import Verdict
from knnssd.engine.sequence import Sequence
from knnssd.engine.skip import Decoder, forward_slots
from knnssd.engine.timing import median_ms

log = logging.getLogger(__name__)

DEFAULT_MEMORY = KV_MEMORY  # bytes of KV cache the slots may hold together
EXPLORE = 16  # a sequence the rule has not let draft for EXPLORE steps per active sequence drafts once, and
# is measured again (figures that once said "not worth it" would otherwise never change)


class Job(Protocol):
    """Something to generate: ``start`` prefills it on a free slot with ``prefill`` (``decode.prefill``'s
    signature) and returns its ``Run``."""

    def start(self, slot: Decoder, prefill: Prefill) -> Run: ...


@dataclass
class PromptJob:
    """A prompt's token ids with its own drafter (drafters keep per-sequence state: one per job)."""

    prompt_ids: list[int]
    drafter: Drafter | None = None
    config: GenerationConfig = GenerationConfig()

    def start(self, slot: Decoder, prefill: Prefill = prefill) -> Run:
        seq, logits, _ = prefill(slot, self.prompt_ids, self.config)
        return Run(seq, logits, self.drafter, self.config)


class JobQueue:
    """Jobs that arrive while a batch runs (serving): ``put`` from any thread; ``decode_batch`` takes
    what is waiting at each step, and waits for one only when it has nothing else to decode."""

    def __init__(self):
        self._items: list[Job] = []
        self._closed = False
        self._ready = threading.Condition()

    def put(self, job: Job) -> None:
        with self._ready:
            if self._closed:
                raise RuntimeError("the queue is closed")
            self._items.append(job)
            self._ready.notify()

    def close(self) -> None:
        """No more jobs: the batch ends once the waiting and running ones are done."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def take(self, block: bool) -> Job | None:
        """The oldest waiting job; None when none waits (``block``: wait for one, None once closed)."""
        with self._ready:
            while block and not self._items and not self._closed:
                self._ready.wait()
            return self._items.pop(0) if self._items else None

    @property
    def closed(self) -> bool:
        with self._ready:
            return self._closed and not self._items


class Prefixes:
    """The prompts of the sequences in a batch, and of finished ones whose slots are free, for the next
    prompts' prefills to reuse (vLLM's prefix caching, over a batch's slots). ``prefill``
    (``decode.prefill``'s signature) finds the one whose prompt shares the most leading tokens with the
    new one, and copies the K/V and states of those positions from its slot (``decode.Reused``) instead
    of computing them, as far as ``decode.reusable`` allows (any number of positions where the prefill's
    attention is the native kernel, else whole blocks of ``CAUSAL_BLOCK``: ``attention.reuse_unit``; the
    rest gets the rows its own prefill would). Few-shot prompts share their examples: in the 64 mixed
    eval prompts of ``bench-throughput``, each summarization prompt starts with the same 354-token
    example article, and every prompt with its chat template's system turn.

    A finished sequence's prompt lends until its slot takes another job (``drop``: its buffers are that
    job's), so a prompt also reuses one that finished before it started: in a server, the request
    before it (vLLM's automatic prefix caching keeps freed blocks the same way, until it evicts them)."""

    def __init__(self):
        self._held: dict[int, _Prompt] = {}  # by id(slot)
        self.reused = 0  # prompt positions copied instead of computed

    def prefill(self, decoder: Decoder, prompt_ids: list[int], config: GenerationConfig, tap: int | None = None
                ) -> tuple[Sequence, torch.Tensor, torch.Tensor]:
        unit = reuse_unit_of(decoder)
        reuse = self._find(prompt_ids, tap, unit)
        seq, logits, states = prefill(decoder, prompt_ids, config, tap, reuse)
        lends = len(prompt_ids) // unit * unit
        if lends:
            self._held[id(decoder)] = _Prompt(decoder, list(prompt_ids[:lends]), states[:lends].clone(), tap)
        self.reused += reuse.n if reuse is not None else 0
        return seq, logits, states

    def drop(self, slot: Decoder) -> None:
        self._held.pop(id(slot), None)

    def _find(self, ids: list[int], tap: int | None, unit: int) -> Reused | None:
        limit = reusable(len(ids), len(ids), unit)
        best, lender = 0, None
        for p in self._held.values():
            if p.tap != tap:  # its states are another layer's
                continue
            common = next((i for i, (a, b) in enumerate(zip(p.ids[:limit], ids[:limit])) if a != b),
                          min(limit, len(p.ids)))
            n = common // unit * unit
            if n > best:
                best, lender = n, p
        return None if lender is None else Reused(best, lender.slot.cache, lender.states[:best], tap)


@dataclass(frozen=True)
class _Prompt:
    """A sequence's prompt as far as it can lend it (whole units, ``attention.reuse_unit``): its slot, which
    holds the K/V, its tokens and the states its prefill returned."""

    slot: Decoder
    ids: list[int]
    states: torch.Tensor
    tap: int | None


@torch.inference_mode()
def prefix_exact(decoder: Decoder, pooled: bool) -> bool:
    """Does a prompt that reuses another's leading positions (``Prefixes``) get the K/V, states and logits its
    own prefill gives? Checked on the real model, bitwise, against each prompt prefilled alone on a slot of
    its own (``pooled``: the slots of one ``SlotPool``): a random prompt of five blocks and 30 tokens lends
    to one of two of its blocks and the fewest tokens a rest may have (a shorter borrower, mostly reused)
    and to one of four of its blocks and 100 tokens (past 512 keys: CPU flash attention's key split);
    where any number of positions may be reused (``attention.reuse_unit``), also to one of its first
    block and 45 tokens, and 60 more (a shared part that ends inside a block)."""
    B = CAUSAL_BLOCK
    slots = decoder.pooled_slots(3)[0] if pooled else [decoder.slot() for _ in range(3)]
    vocab = decoder.stack.embed.shape[0]
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    lender = rand(5 * B + 30)
    cfg = GenerationConfig(max_new_tokens=1)
    store = Prefixes()
    store.prefill(slots[0], lender, cfg)
    cases = [(2 * B, PREFILL_ROWS + 1), (4 * B, 100)]  # (tokens shared, tokens after them)
    if reuse_unit_of(decoder) < B:
        cases.append((B + 45, 60))
    for shared, rest in cases:
        ids = lender[:shared] + [(lender[shared] + 1) % vocab] + rand(rest - 1)  # the rest differs from its first
        before = store.reused
        _, logits, states = store.prefill(slots[1], ids, cfg)
        _, own_logits, own_states = prefill(slots[2], ids, cfg)
        store.drop(slots[1])
        kv = lambda c: [t[:, :, : len(ids)] for t in c.k + c.v]  # noqa: E731
        if not (store.reused - before == shared and torch.equal(logits, own_logits)
                and torch.equal(states, own_states)
                and all(torch.equal(a, b) for a, b in zip(kv(slots[1].cache), kv(slots[2].cache)))):
            return False
    return True


@dataclass
class Finished:
    job: Job
    tokens: list[int]
    stats: DecodeStats


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
    for t, run in _packed_passes(decoder, slots, per_seq, context, pooled):
        out.append((slots * t, median_ms(run, decoder.device, repeats) / 1e3))
    return PassCosts(tuple(r for r, _ in out), tuple(s for _, s in out))


def _packed_passes(decoder: Decoder, slots: int, per_seq: tuple[int, ...], context: int, pooled: bool
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


def _at(counts: list[int], j: int) -> int:
    return counts[j] if j < len(counts) else 0


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
        return type(run.drafter).__name__

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
                s_kind = (_at(kind.kept, j) + p * 0.5 ** (j + 1)) / (_at(kind.tried, j) + p)  # towards 1/2^j
                last = min(last, (_at(s.accepted_at, j) + p * s_kind) / (_at(s.drafted_at, j) + p))
                curve.append(last)
            survival.append(curve)
        return survival, seconds


@dataclass
class BatchStats:
    """What a batched run did, per step: sequences in it, packed rows, drafted and emitted tokens, and
    the pass's seconds; and its prefills."""

    slots: int
    active: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)
    pass_s: list[float] = field(default_factory=list)
    prefills: int = 0
    prefill_s: float = 0.0
    reused: int = 0  # prompt positions whose K/V were copied from another prompt in the batch (``Prefixes``)
    total_s: float = 0.0
    exact: bool = False  # packed passes measured row-invariant up to the most rows a step may have

    @property
    def steps(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        """Tokens generated: each prefill's first token and what every step emitted."""
        return self.prefills + sum(self.emitted)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0

    def summary(self) -> dict:
        n = max(1, self.steps)
        return {"slots": self.slots, "steps": self.steps, "prefills": self.prefills, "tokens": self.tokens,
                "tokens_per_s": self.tokens_per_s, "rows_per_step": sum(self.rows) / n,
                "draft_per_step": sum(self.drafted) / n, "active_per_step": sum(self.active) / n,
                "prefill_s": self.prefill_s, "reused": self.reused, "exact": self.exact}


def rows_exact(decoder: Decoder, max_rows: int) -> bool:
    """Are the decoder's projections and lm_head row-invariant for packed calls of up to ``max_rows``
    rows (``exactness.linears_invariant``)? Attention runs per sequence, as a sequence's own pass
    runs it, so these are the only calls packing changes. False unless the decoder's own step is exact."""
    ex = decoder.exactness
    return bool(ex is not None and ex.exact and exactness.linears_invariant(decoder.stack, max_rows))


@torch.inference_mode()
def pooled_exact(decoder: Decoder, slots: int) -> bool:
    """Does attention batched over a ``SlotPool`` (``forward_slots(..., pool)``) give every sequence the
    logits its own pass gives (and, through the later passes, the K/V)? Checked on the real model:
    ``slots`` sequences of random tokens at three key lengths placed so that, from 4 slots on, one
    group is read as a copy of its rows and one as a slice (from 8, one with a non-member inside),
    three packed passes (mixed draft lengths up to ``max_t``, one-token steps that read what the
    first wrote, the lengths reversed), each against every slot's own pass on a cache of its own,
    bitwise. False where the step has no
    batched form or is not exact itself."""
    ex = decoder.exactness
    if ex is None or not ex.exact or not decoder.attention.poolable:
        return False
    max_t = ex.max_t
    pooled, pool = decoder.pooled_slots(slots)
    own = [decoder.slot() for _ in range(slots)]
    vocab = decoder.stack.embed.shape[0]
    g = torch.Generator().manual_seed(7)
    starts = []
    for b in range(slots):
        # key lengths by position (``KVCache.keys``): C at both ends (a copied group), else A or B (every
        # third slot): 8 slots read C,B,A,A,B,A,A,C (two copied groups, a slice with a non-member inside);
        # each sequence starts 3 to 5 positions before a key-length boundary, so its passes of 4 rows and
        # more straddle it (a sequence in two calls, one of them shared with the next length's slots)
        extra = 2 if slots > 2 and b in (0, slots - 1) else 1 if b % 3 == 1 else 0
        ids = torch.randint(0, vocab, (SPAN * (1 + extra) - 3 - b % 3,), generator=g).to(decoder.device)
        for s in (pooled[b], own[b]):
            s.reserve(ids.shape[0] + 2 * max_t + 1)
            s.forward(ids, 0)
        starts.append(ids.shape[0])
    mixed = [1 + (b * 5) % max_t for b in range(slots)]
    for rows in (mixed, [1] * slots, mixed[::-1]):
        calls = [(torch.randint(0, vocab, (t,), generator=g).to(decoder.device), s) for t, s in zip(rows, starts)]
        packed = forward_slots(pooled, calls, pool)
        if not all(torch.equal(x, s.forward(ids, start).logits) for x, s, (ids, start) in zip(packed, own, calls)):
            return False
        starts = [s + t for s, t in zip(starts, rows)]
    return True


def slot_bytes(decoder: Decoder, positions: int) -> int:
    """KV-cache bytes of one slot holding ``positions`` (rounded up to the cache's bucket)."""
    s, cache = decoder.stack, decoder.cache
    per = torch.empty((), dtype=cache.dtype).element_size()
    return 2 * s.n_layers * s.n_kv * s.head_dim * cache.bucket(positions) * per


def max_slots(decoder: Decoder, positions: int, memory: int = DEFAULT_MEMORY) -> int:
    """How many slots of ``positions`` fit in ``memory`` bytes of KV cache (at least 1)."""
    return max(1, memory // slot_bytes(decoder, positions))


def check_slots(decoder: Decoder, slots: int, positions: int, name: str) -> None:
    """A batch size asked for (``name``: the option or variable) within the KV-cache budget, in one line
    before any plan or pass: 100,000 slots never finished planning, or ran out of memory."""
    most = max_slots(decoder, positions)
    if slots > most:
        raise too_many_slots(name, slots, most, positions, DEFAULT_MEMORY)


AUTO_SLOTS = (1, 2, 4, 8, 16, 32, 64)
# More slots must raise plain decoding's tokens/s by this much over the slots chosen so far. At 1.25 a 2-core
# Zen 4 picked 16 or 32 slots from run to run (measured gain 1.2-1.3 at 64 positions), and 32 was 10-12%
# faster than 16 in every throughput run; 64 slots were 3-4% faster than 32 over 64 prompts then, and 8-15%
# after the native linear kernel. At 1.1 the measured gain of 64 over 32 slots (1.11-1.19 in three runs)
# fell short in one of three picks (32 slots), and a throughput run's pick, which then stopped at the first size
# that gained too little, was 16 slots.
AUTO_GAIN = 1.05
AUTO_ROUNDS = 7  # timed passes of each of the two sizes compared (alternately, each after one untimed)


def auto_slots(decoder: Decoder, positions: int, jobs: int, memory: int = DEFAULT_MEMORY) -> int:
    """The batch size ``--batch-size auto`` picks: of the sizes in ``AUTO_SLOTS`` (within the memory
    budget and the number of jobs), in increasing order, each whose plain batched decoding's tokens/s
    (slots / v(slots), one-row passes at 64 positions) is ``AUTO_GAIN`` times the last chosen size's or
    more, the two sizes timed alternately (medians). Every size is measured (one that gains too little
    does not end the search): on a 2-core Zen 4, ``bench-throughput``'s 64 prompts ran 18% faster with
    64 slots than with the 16 a run picked when the first such size ended it."""
    limit = min(max_slots(decoder, positions, memory), max(1, jobs))
    pooled = decoder.attention.poolable
    best, best_pass = 1, None
    for n in (x for x in AUTO_SLOTS if x <= limit):
        (_, run), = _packed_passes(decoder, n, (1,), 64, pooled)
        if best_pass is None:
            best, best_pass = n, run
            continue
        ms = {best: [], n: []}
        for _ in range(AUTO_ROUNDS):  # alternately, so both sizes see the same drift of the machine
            for size, f in ((best, best_pass), (n, run)):
                ms[size].append(median_ms(f, decoder.device, repeats=1))
        gain = n / statistics.median(ms[n]) / (best / statistics.median(ms[best]))
        log.debug("batch size auto: %d slots against %d: %.2fx the tokens/s", n, best, gain)
        if gain >= AUTO_GAIN:
            best, best_pass = n, run
    log.info("batch size auto: %d slots (of at most %d by memory and jobs)", best, limit)
    return best


@dataclass(frozen=True)
class BatchPlan:
    """What a batched run of a decoder needs measured once: its slots, v(R), whether packed passes of
    up to ``slots * max_t`` rows are row-invariant (then outputs are exact), whether attention
    runs batched over the slots (``pooled``: measured exact, ``pooled_exact``) or per sequence, and
    the positions each pooled slot is allocated at the start (``positions``; 0: as jobs reserve them),
    and whether prompts reuse the leading positions of others in the batch (``shares``: measured exact,
    ``prefix_exact``); ``recalled``: ``pooled`` and ``shares`` were taken from a record (``plan``)."""

    slots: int
    costs: PassCosts
    exact: bool
    pooled: bool = False
    positions: int = 0
    shares: bool = False
    recalled: bool = False


# The engine code the checks run besides the forward pass (the record's name, from
# ``models.LoadedModel.batch_record``, carries the forward pass's code through ``exactness.machine_key``).
CHECK_CODE = tuple(Path(__file__).parent / f for f in ("batched.py", "decode.py", "sequence.py"))


def plan(decoder: Decoder, slots: int, positions: int = 0, memory: int = DEFAULT_MEMORY,
         record: Path | None = None) -> BatchPlan:
    """Measure what a batched run of ``slots`` sequences needs. Where a projection is not row-invariant
    up to ``slots * max_t`` rows, its form is chosen again over that range (``exactness.pad_linears``:
    the decoder's own passes stay exact, as the new forms are invariant over a wider range). Attention
    is batched over the slots where that is measured exact, and runs per sequence otherwise.

    ``positions``: the most a job of the run reserves (prompt + new tokens), when known. The pooled
    slots are then allocated that long at the start, as far as ``memory`` allows, instead of growing
    as longer prompts arrive: a growth copies every slot's cache (on a 2-core Zen 4, 0.8 s for 16
    bf16 SmolLM2 slots of 1,200 positions), and a run of mixed prompts grew several times.

    ``record``: a file under the same name as the decoder's probe record (``exactness``: the same
    model, dtype, device and machine key). Where packed passes are row-invariant, what the two slow
    checks found (``pooled_exact``, ``prefix_exact``) is kept there per slot count, with a hash of the
    code they ran, the attention step, ``max_t`` and each linear's form, and the next plan of as many
    slots under the same key takes it instead of measuring again: on a 2-core Zen 1 in fp32, they took
    12 s of SmolLM2's 16 s plan for 4 slots and 20 s of 30 for 16. Row-invariance (which may change the
    linears' forms) and the pass costs are always measured."""
    ex = decoder.exactness
    max_t = ex.max_t if ex is not None else 12
    exact = _rows(decoder, slots, max_t)
    code = _record_code(decoder, max_t) if record is not None else None
    kept = _entries(exactness.read_record(record), code).get(str(slots))
    recalled = exact and isinstance(kept, dict)
    if recalled:
        pooled, shares = kept.get("pooled") is True, kept.get("shares") is True  # a wrong True costs exactness
        log.info("batched checks for %d slots taken from %s", slots, record)
    else:
        pooled = exact and pooled_exact(decoder, slots)
        # rotary tables that depend on the sequence's length (dynamic NTK, longrope) rotate a lender's keys
        shares = slots > 1 and decoder.stack.rope_static and prefix_exact(decoder, pooled)
        if record is not None and exact:
            entry = {"pooled": bool(pooled), "shares": bool(shares)}
            exactness.update_record(record, lambda now: {"code": code,
                                                         "slots": {**_entries(now, code), str(slots): entry}})
    log.info("batched attention over %d slots: %s", slots, "one call per key length" if pooled else
             "per sequence (no batched form measured exact for this step)")
    log.info("prompts reuse the leading positions of others in the batch: %s", "yes" if shares else
             "no (not measured exact for this prefill, or rotary tables set by the length)")
    costs = measure_pass_costs(decoder, slots, tuple(sorted({1, min(4, max_t), max_t})), repeats=2, pooled=pooled)
    if slots > 1:  # and one sequence alone, as at low load: below ``slots`` rows v would be flat at v(slots)
        costs = costs.joined(measure_pass_costs(decoder, 1, (1, max_t), repeats=2, pooled=pooled))
    fits = memory // (slots * slot_bytes(decoder, BUCKET) // BUCKET) // BUCKET * BUCKET  # positions within memory
    return BatchPlan(slots, costs, exact, pooled, min(KVCache.bucket(positions), fits) if positions else 0, shares,
                     recalled)


def _entries(known: dict, code: str | None) -> dict:
    """A plan record's checks by slot count, where it was written by the same ``code`` (else none)."""
    by_slots = known.get("slots") if code is not None and known.get("code") == code else None
    return by_slots if isinstance(by_slots, dict) else {}


def _record_code(decoder: Decoder, max_t: int) -> str:
    """What the plan record's checks depend on besides the machine key: the code they ran (``CHECK_CODE``),
    the attention step (the probe may choose another when measured again), ``max_t``, and a hash of each
    projection's and the head's form (``RowPadded`` over a packed one, ...), in order: a plan may change
    the forms, and the checks' prefills run far more rows than ``rows_exact`` covers."""
    def form(lin) -> str:
        inner = getattr(lin, "inner", None)
        return type(lin).__name__ + (f"({type(inner).__name__})" if inner is not None else "")

    s = decoder.stack
    forms = hashlib.sha256("|".join(form(lin) for lin in (*s.projections(), s.lm_head)).encode()).hexdigest()
    return f"{exactness.source_digest(CHECK_CODE)[:12]}-{decoder.attention.name}-{max_t}-{forms[:12]}"


def _rows(decoder: Decoder, slots: int, max_t: int) -> bool:
    """Are packed passes of ``slots`` sequences row-invariant (``rows_exact``), after changing the linears'
    forms where needed?"""
    ex = decoder.exactness
    exact = rows_exact(decoder, slots * max_t)
    if ex is not None and ex.exact and not exact:
        stack, changed = exactness.pad_linears(decoder.stack, max_t, max_rows=slots * max_t)
        if changed:
            decoder.use_stack(stack)
            exact = rows_exact(decoder, slots * max_t)
    if ex is not None and ex.exact and not exact:
        log.warning("packed passes of %d sequences are not row-invariant here: batched output may differ from "
                    "plain decoding where two tokens nearly tie (use fewer slots, or --dtype %s)", slots,
                    "float32" if decoder.device.type == "cpu" else "bfloat16")  # on an H200, fp32 was not
    return exact


def decode_batch(decoder: Decoder, jobs: Iterable[Job] | JobQueue, plan: BatchPlan,
                 stats: BatchStats | None = None,
                 failed: Callable[[Job, Exception], None] | None = None) -> Iterator[Finished]:
    """Generate every job, ``plan.slots`` at a time, yielding each as it finishes (not in job order).
    ``jobs``: a list or iterator, or a ``JobQueue`` that others fill while the batch runs (the batch
    ends when it is closed and drained). ``stats`` collects the per-step figures (``BatchStats``);
    each job's ``DecodeStats`` counts its own prefill, drafts and the passes it was in. ``failed``:
    where a job whose start (its prefill and routing) raises goes, its slot freed, while the others
    go on (a server's requests are not failed by another's); without it the exception ends the batch."""
    stats = stats if stats is not None else BatchStats(plan.slots)
    stats.exact = plan.exact
    if plan.pooled:
        free, pool = decoder.pooled_slots(plan.slots)
        pool.grow(plan.positions)
    else:
        free, pool = [decoder.slot() for _ in range(plan.slots)], None
    if isinstance(jobs, JobQueue):
        take, more = jobs.take, lambda: not jobs.closed
    else:
        it = iter(jobs)
        pending: list[Job] = []

        def take(block: bool) -> Job | None:
            return pending.pop() if pending else next(it, None)

        def more() -> bool:
            if not pending:
                job = next(it, None)
                if job is not None:
                    pending.append(job)
            return bool(pending)
    active: list[_Active] = []
    prefixes = Prefixes()
    model = DraftModel()
    t_start = time.perf_counter()
    log.info("batched decoding: %d slots; draft lengths maximise expected tokens/s given %s, each sequence's "
             "acceptance and its draft cost", plan.slots, plan.costs.describe())
    debug = log.isEnabledFor(logging.DEBUG)

    def finish(a: _Active) -> Finished:
        free.append(a.slot)  # its prompt lends (``Prefixes``) until the slot takes another job
        model.finished(a.run)
        tokens, st = a.run.finish()
        st.exact = st.exact and plan.exact
        st.total_s = time.perf_counter() - a.t0
        return Finished(a.job, tokens, st)

    def start(limit: int) -> Iterator[Finished]:
        for _ in range(min(limit, len(free))):
            job = take(not active)  # wait for a job only when nothing else is decoding
            if job is None:
                return
            t0 = time.perf_counter()
            slot = free.pop(0)  # the slot free longest: the prompts that finished last lend longer
            prefixes.drop(slot)  # its buffers are this job's now
            a = _Active(job, slot, None, t0)
            reused = prefixes.reused
            try:
                a.run = job.start(a.slot, prefixes.prefill if plan.shares else prefill)
            except Exception as e:
                if failed is None:
                    raise
                free.insert(0, slot)
                failed(job, e)
                continue
            a.run.stats.prefill_s = time.perf_counter() - t0
            stats.prefills += 1
            stats.prefill_s += a.run.stats.prefill_s
            stats.reused += prefixes.reused - reused
            if a.run.done:
                yield finish(a)
            else:
                active.append(a)

    yield from start(plan.slots)
    while active or more():
        if not active:
            yield from start(plan.slots)
            continue
        runs = [a.run for a in active]
        caps = [r.draft_cap() for r in runs]
        survival, draft_s = model(runs, caps)
        ks = choose_lengths(caps, survival, draft_s, plan.costs)
        for b, a in enumerate(active):  # a sequence whose drafts the rule has not chosen for long drafts once
            a.idle = 0 if ks[b] else a.idle + 1
            if caps[b] and a.idle >= EXPLORE * len(active):
                ks[b], a.idle = caps[b], 0
        if debug:
            log.debug("step %d: caps %s, s(1) %s, draft s/call %s -> k %s", stats.steps, caps,
                      [round(x[0], 2) if x else None for x in survival], [round(x, 4) for x in draft_s], ks)
        calls = [r.propose(k) for r, k in zip(runs, ks)]
        t0 = time.perf_counter()
        logits = forward_slots([a.slot for a in active], [(c.ids, c.start) for c in calls], pool)
        packed = [r.judge(c, x) for r, c, x in zip(runs, calls, logits)]
        emitted = sum(r.apply(v) for r, v in zip(runs, Verdict.read_all(packed)))  # the step's one host read
        dt = time.perf_counter() - t0
        stats.active.append(len(runs))
        stats.rows.append(sum(c.rows for c in calls))
        stats.drafted.append(sum(c.rows - 1 for c in calls))
        stats.emitted.append(emitted)
        stats.pass_s.append(dt)
        for r in runs:
            r.stats.verify_s += dt
        done = [a for a in active if a.run.done]
        active[:] = [a for a in active if not a.run.done]
        for a in done:
            yield finish(a)
        stats.total_s = time.perf_counter() - t_start
        yield from start(plan.slots if not active else 1)  # while others run, one prefill per step
    stats.total_s = time.perf_counter() - t_start


@dataclass
class _Active:
    job: Job
    slot: Decoder
    run: Run | None
    t0: float
    idle: int = 0  # steps since this sequence last drafted
