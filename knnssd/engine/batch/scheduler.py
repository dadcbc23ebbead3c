"""Batched speculative decoding: several sequences advance together, one full-model pass per step.

Each sequence runs in its own slot of the decoder (``Decoder.slot``: the same weights, a KV cache of
its own) with its own drafter. A step:

    k_b   = choose_lengths(...)                   # draft lengths (a tree's: nodes) from goodput, down to 0
    call_b = run_b.propose(k_b)                   # each sequence drafts on its slot
    logits = forward_slots(slots, calls, pool)    # one pass: every sequence's rows packed together
    run_b.apply(verdict_b)                        # verify on the device (run_b.judge), read every verdict
                                                  # in one host copy, emit, roll back (decode.Run)

A greedy sequence whose drafter drafts token trees (``tree.py``) proposes a tree of k_b nodes where the
packed pass verifies trees (the native layers over a slot pool: ``tree_pass.packs_trees``); its rows are
priced as any rows, and its verdict is read on its own (``tree.accept_greedy``). Elsewhere it drafts
chains.

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

The draft lengths are ``draft_lengths``' rule, prefix reuse is ``prefixes``', and what a run measures
before it starts (slots, pass costs, the exactness checks) is ``plan``'s.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from knnssd.engine.batch.plan import BatchPlan
from knnssd.engine.spec.loop import DecodeStats, GenerationConfig, Prefill, Run, prefill
from knnssd.engine.batch.draft_lengths import EXPLORE, DraftModel, choose_lengths
from knnssd.engine.spec.drafters import Drafter
from knnssd.engine.batch.prefixes import Prefixes
from knnssd.engine.spec.sampling import Verdict
from knnssd.engine.model import tree
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.packed import forward_slots
from knnssd.engine.model.tree_pass import packs_trees, settle_slots

log = logging.getLogger(__name__)


class Job(Protocol):
    """Something to generate: ``start`` prefills it on a free slot with ``prefill`` (``loop.prefill``'s
    signature) and returns its ``Run``. Once ``cancelled`` is true (set from any thread), a waiting job is
    dropped and a running one leaves its slot at the next step, finished with stop ``"cancelled"`` (a
    server's client that went away)."""

    cancelled: bool

    def start(self, slot: Decoder, prefill: Prefill) -> Run: ...


class Cancelled(Exception):
    """What ``failed`` gets for a job cancelled before it started."""


@dataclass
class PromptJob:
    """A prompt's token ids with its own drafter (drafters keep per-sequence state: one per job)."""

    prompt_ids: list[int]
    drafter: Drafter | None = None
    config: GenerationConfig = GenerationConfig()
    cancelled: bool = False

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

    def __len__(self) -> int:
        """Jobs waiting for a slot."""
        with self._ready:
            return len(self._items)


@dataclass
class Finished:
    job: Job
    tokens: list[int]
    stats: DecodeStats


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
    plan_s: float = 0.0  # choosing the batch size and checking its packed passes, before the first prefill
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
                "prefill_s": self.prefill_s, "reused": self.reused, "plan_s": self.plan_s, "exact": self.exact}


def decode_batch(decoder: Decoder, jobs: Iterable[Job] | JobQueue, plan: BatchPlan,
                 stats: BatchStats | None = None, failed: Callable[[Job, Exception], None] | None = None,
                 on_step: Callable[[list[Run]], None] | None = None) -> Iterator[Finished]:
    """Generate every job, ``plan.slots`` at a time, yielding each as it finishes (not in job order).
    ``jobs``: a list or iterator, or a ``JobQueue`` that others fill while the batch runs (the batch
    ends when it is closed and drained). ``stats`` collects the per-step figures (``BatchStats``);
    each job's ``DecodeStats`` counts its own prefill, drafts and the passes it was in. ``failed``:
    where a job whose start (its prefill and routing) raises goes, its slot freed, while the others
    go on (a server's requests are not failed by another's); without it the exception ends the batch.
    ``on_step``: as ``Scheduler``'s."""
    yield from Scheduler(decoder, jobs, plan, stats, failed, on_step).run()


class Scheduler:
    """The batch's step loop, which ``decode_batch`` runs to its end: ``start`` fills free slots with jobs
    (prefills), ``step`` runs one packed full-model pass for the active sequences and yields those that
    finished. ``on_step``, when given, is called after each step with the active runs, so that a server
    can follow every sequence's tokens as they are emitted."""

    def __init__(self, decoder: Decoder, jobs: Iterable[Job] | JobQueue, plan: BatchPlan,
                 stats: BatchStats | None = None, failed: Callable[[Job, Exception], None] | None = None,
                 on_step: Callable[[list[Run]], None] | None = None):
        self.plan, self.failed, self.on_step = plan, failed, on_step
        decoder = plan.decodes_on or decoder  # a plan on static slots runs there, over the same weights
        self.stats = stats if stats is not None else BatchStats(plan.slots)
        self.stats.exact = plan.exact
        if plan.pooled:
            self.free, self.pool = decoder.pooled_slots(plan.slots)
            self.pool.grow(plan.positions)
        else:
            self.free, self.pool = [decoder.slot() for _ in range(plan.slots)], None
        if isinstance(jobs, JobQueue):
            self._take, self._more = jobs.take, lambda: not jobs.closed
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

            self._take, self._more = take, more
        self.trees = bool(self.free) and packs_trees(self.free[0], self.pool)  # whether a pass verifies token trees
        self.active: list[_Active] = []
        self.prefixes = Prefixes()
        self.model = DraftModel()
        self._debug = log.isEnabledFor(logging.DEBUG)

    def run(self) -> Iterator[Finished]:
        t_start = time.perf_counter()
        log.info("batched decoding: %d slots; draft lengths maximise expected tokens/s given %s, each sequence's "
                 "acceptance and its draft cost", self.plan.slots, self.plan.costs.describe())
        yield from self.start(self.plan.slots)
        while self.active or self._more():
            if not self.active:
                yield from self.start(self.plan.slots)
                continue
            yield from self.drop_cancelled()
            if not self.active:
                continue
            yield from self.step()
            self.stats.total_s = time.perf_counter() - t_start
            yield from self.start(self.plan.slots if not self.active else 1)  # while others run, one prefill a step
        self.stats.total_s = time.perf_counter() - t_start

    def _finish(self, a: "_Active") -> Finished:
        self.free.append(a.slot)  # its prompt lends (``Prefixes``) until the slot takes another job
        self.model.finished(a.run)
        tokens, st = a.run.finish()
        st.exact = st.exact and self.plan.exact
        st.total_s = time.perf_counter() - a.t0
        return Finished(a.job, tokens, st)

    def start(self, limit: int) -> Iterator[Finished]:
        """Prefill up to ``limit`` waiting jobs on free slots, yielding each that is done at once (a job
        that ends at its first token is yielded before the next one is waited for)."""
        stats, prefixes = self.stats, self.prefixes
        for _ in range(min(limit, len(self.free))):
            job = self._take(not self.active)  # wait for a job only when nothing else is decoding
            if job is None:
                return
            if job.cancelled:
                if self.failed is not None:
                    self.failed(job, Cancelled())
                continue
            t0 = time.perf_counter()
            slot = self.free.pop(0)  # the slot free longest: the prompts that finished last lend longer
            prefixes.drop(slot)  # its buffers are this job's now
            a = _Active(job, slot, None, t0)
            reused = prefixes.reused
            try:
                a.run = job.start(a.slot, prefixes.prefill if self.plan.reuses_prefixes else prefill)
            except Exception as e:
                if self.failed is None:
                    raise
                self.free.insert(0, slot)
                self.failed(job, e)
                continue
            a.run.trees = a.run.trees and self.trees
            a.run.stats.prefill_s = time.perf_counter() - t0
            stats.prefills += 1
            stats.prefill_s += a.run.stats.prefill_s
            stats.reused += prefixes.reused - reused
            if a.run.done:
                yield self._finish(a)
            else:
                self.active.append(a)

    def drop_cancelled(self) -> Iterator[Finished]:
        """Free the slots of cancelled sequences, yielding each (stop ``"cancelled"``)."""
        gone = [a for a in self.active if a.job.cancelled]
        for a in gone:
            self.active.remove(a)
            a.run.stats.stop = "cancelled"
            yield self._finish(a)

    def step(self) -> Iterator[Finished]:
        """One packed pass: draft lengths by the goodput rule, each sequence drafts, one full-model pass
        verifies every draft, each sequence emits and rolls back; yields the sequences that finished."""
        active, stats = self.active, self.stats
        runs = [a.run for a in active]
        caps = [r.node_cap() if r.trees else r.draft_cap() for r in runs]
        survival, draft_s = self.model(runs, caps)
        ks = choose_lengths(caps, survival, draft_s, self.plan.costs)
        for b, a in enumerate(active):  # a sequence whose drafts the rule has not chosen for long drafts once
            a.idle = 0 if ks[b] else a.idle + 1
            if caps[b] and a.idle >= EXPLORE * len(active):
                ks[b], a.idle = caps[b], 0
        if self._debug:
            log.debug("step %d: caps %s, s(1) %s, draft s/call %s -> k %s", stats.steps, caps,
                      [round(x[0], 2) if x else None for x in survival], [round(x, 4) for x in draft_s], ks)
        # a tree of k nodes is at most k deep, and its chain fallback at most k long: the rows the rule priced
        calls = [r.propose(k, as_tree=True, nodes=k) if r.trees else r.propose(k) for r, k in zip(runs, ks)]
        parents = [c.draft.parents if c.draft is not None else None for c in calls]
        t0 = time.perf_counter()
        slots = [a.slot for a in active]
        logits = forward_slots(slots, [(c.ids, c.start) for c in calls], self.pool, parents if self.trees else None)
        chains = [b for b, p in enumerate(parents) if p is None]
        verdicts = dict(zip(chains, Verdict.read_all([runs[b].judge(calls[b], logits[b]) for b in chains])
                            if chains else []))
        trees = [b for b, p in enumerate(parents) if p is not None]  # one host read each
        verdicts.update({b: tree.accept_greedy(calls[b].draft.host, parents[b], logits[b]) for b in trees})
        if trees:
            settle_slots([slots[b] for b in trees], [calls[b].start for b in trees],
                         [verdicts[b].path for b in trees], self.pool)
        emitted = sum(r.apply(verdicts[b]) for b, r in enumerate(runs))
        dt = time.perf_counter() - t0
        stats.active.append(len(runs))
        stats.rows.append(sum(c.rows for c in calls))
        stats.drafted.append(sum(c.rows - 1 for c in calls))
        stats.emitted.append(emitted)
        stats.pass_s.append(dt)
        for r in runs:
            r.stats.verify_s += dt
        if self.on_step is not None:
            self.on_step(runs)
        done = [a for a in active if a.run.done]
        active[:] = [a for a in active if not a.run.done]
        for a in done:
            yield self._finish(a)


@dataclass
class _Active:
    job: Job
    slot: Decoder
    run: Run | None
    t0: float
    idle: int = 0  # steps since this sequence last drafted
