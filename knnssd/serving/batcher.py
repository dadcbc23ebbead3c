"""Concurrent requests decoded together: one thread runs a continuous batch (``engine.batch.scheduler``) over
a queue; each request puts its prompts in and follows them, token by token (``submit``: the
OpenAI server's streams) or to the end (``generate``: the pyfunc model).

A request that arrives while others are decoding joins the running batch at the next free slot,
so 16 requests at once take about as many full-model passes as the longest of them needs, instead
of 16 times as many. Where the packed passes are exact (``BatchPlan.exact``), every answer equals
its one-at-a-time generation.

The batch's thread also loads the model, and builds a swapped-in bank's generator: all the engine's
torch work runs on that one thread. Torch's CPU threads are OpenMP's, and OpenMP keeps a pool of
worker threads for each thread that runs parallel work; once two pools are alive (the loading
thread's and the batch's) there are more OpenMP threads than cores on a small machine, and libgomp
stops letting idle workers spin, which slowed every step of the batch's thread (docs/benchmarks.md).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from knnssd.engine.batch.plan import BatchPlan
from knnssd.engine.batch.scheduler import JobQueue, Scheduler
from knnssd.engine.spec.loop import Prefill, Run, prefill
from knnssd.engine.spec.request_params import GenerateParams, Limits, check_fits
from knnssd.routing.bank import Bank
from knnssd.serving.routed import Result, RoutedGenerator, RoutedJob

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests wait for a slot than the server takes (``max_queue``)."""


@dataclass(eq=False)
class StreamJob(RoutedJob):
    """One prompt in the running batch. On the batch's thread: ``on_tokens`` gets each step's newly
    verified tokens, ``on_done`` the ``Result`` (stop ``"cancelled"`` once ``cancelled`` was set) or
    the exception that ended it. ``current`` gives the generator to route with when it starts (the
    bank swapped in last)."""

    on_tokens: Callable[[list[int]], None] | None = None
    on_done: Callable[[Result | BaseException], None] | None = None
    current: Callable[[], RoutedGenerator] | None = None
    sent: int = 0  # tokens passed to on_tokens
    t_submit: float = 0.0

    __hash__ = object.__hash__  # one job is one request, whatever its fields hold
    __eq__ = object.__eq__

    def start(self, slot, prefill: Prefill = prefill, drafter=None) -> Run:
        if self.current is not None:
            self.gen = self.current()
        run = super().start(slot, prefill, drafter)
        self.publish(run.new)  # the first token, from the prefill
        return run

    def publish(self, new: list[int]) -> None:
        if len(new) > self.sent and self.on_tokens is not None:
            self.on_tokens(new[self.sent:])
        self.sent = len(new)


class Batcher:
    """``load`` runs on the batch's thread and returns the generator and the batch's plan (None: the
    generator cannot batch, or one slot was asked for; the thread then ends, and neither ``generate``
    nor ``submit`` is used). The constructor returns once it has, raising what it raised.
    ``max_queue``: how many requests may wait for a slot (None: any number). ``observer``: told of
    each step (``ServerMetrics``). ``max_len``: the most positions (prompt and new tokens) a request may
    take (None: the model's ``Limits``); ``submit`` refuses more."""

    def __init__(self, load: Callable[[], tuple[RoutedGenerator, BatchPlan | None]], max_queue: int | None = None,
                 observer=None, max_len: int | None = None):
        self.gen: RoutedGenerator | None = None
        self.plan: BatchPlan | None = None
        self.max_len = max_len
        self.version: str | None = None  # the bank version served, where the caller names it (``swap``)
        self.max_queue, self.observer = max_queue, observer
        self._queue = JobQueue()
        self._waiting: set[StreamJob] = set()
        self._lock = threading.Lock()
        self._pending: tuple[Bank, str | None, str | None] | None = None  # a bank to swap in (and the version
        # it replaces), on the batch's thread
        self._scheduler: Scheduler | None = None
        loaded: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(load, loaded), name="knnssd-batch", daemon=True)
        self._thread.start()
        loaded.result()

    def _run(self, load, loaded: Future) -> None:
        try:
            self.gen, self.plan = load()  # set before the constructor returns and before the loop reads them
        except BaseException as e:  # noqa: BLE001 - the constructor raises it
            loaded.set_exception(e)
            return
        loaded.set_result(None)
        if self.plan is not None:
            self._loop()

    @classmethod
    def routed(cls, bank_dir, model: str | None, dtype: str, device: str, slots: int | None, option: str,
               plain: bool = False, always: bool = False, max_len: int | None = None, **kw) -> "Batcher":
        """The batch over a bank folder's generator (``slots``: None for as many as fit, ``option``: the
        setting that named them, for its error), loaded on the batch's thread; ``always``: a batch of
        one slot too (else one slot means no batch: the caller generates one at a time); ``max_len``: the
        most positions a request may take (``serving_plan``)."""

        def load():
            gen = RoutedGenerator.from_bank_dir(bank_dir, model=model, dtype=dtype, device=device)
            gen.plain = plain
            return gen, serving_plan(gen, slots, option, always, max_len)

        return cls(load, max_len=max_len, **kw)

    @property
    def batching(self) -> bool:
        return self.plan is not None

    @property
    def limits(self) -> Limits:
        """What one request may hold here: the model's ``Limits``, within ``max_len``."""
        return dataclasses.replace(self.gen.lm.limits, cap=self.max_len)

    @property
    def prompt_tokens(self) -> int:
        """The most prompt tokens a request may take: all but one of ``max_len``, else the default settings'
        ``max_prompt_tokens``, what unbounded slots are planned for (``serving_plan``)."""
        return self.max_len - 1 if self.max_len is not None else GenerateParams().max_prompt_tokens

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def slots(self) -> int:
        return self.plan.slots if self.plan is not None else 1

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        s = self._scheduler
        return len(s.active) if s is not None else 0

    def submit(self, prompt: str, params: GenerateParams, on_tokens: Callable[[list[int]], None] | None = None,
               on_done: Callable[[Result | BaseException], None] | None = None) -> StreamJob:
        """Queue ``prompt``; a bad one raises ``ValueError``, a full queue ``QueueFull``, before anything
        is queued. Set the returned job's ``cancelled`` to drop it."""
        return self.submit_ids(*self.gen.tokenize(prompt, params), params, on_tokens, on_done)

    def submit_ids(self, ids: list[int], truncated: bool, params: GenerateParams,
                   on_tokens: Callable[[list[int]], None] | None = None,
                   on_done: Callable[[Result | BaseException], None] | None = None) -> StreamJob:
        """``submit`` for a prompt already tokenized by ``gen.tokenize`` with ``params``."""
        check_fits(len(ids), params, self.limits)  # the server checked already; static slots do not grow
        job = StreamJob(self.gen, ids, truncated, params, on_tokens=on_tokens, on_done=on_done,
                        current=self._current, t_submit=time.perf_counter())
        with self._lock:
            # what waits in the queue beyond the free slots (the batch starts one new sequence a step while
            # others run, so a burst waits there a few steps even with slots free)
            waiting = len(self._queue) - max(0, self.slots - self.active)
            if self.max_queue is not None and waiting >= self.max_queue:
                raise QueueFull(f"{waiting} requests already wait for a slot")
            self._waiting.add(job)
            self._queue.put(job)
        return job

    def generate(self, prompts: list[str], params: GenerateParams) -> list[Result]:
        """Results for ``prompts`` in their order, decoded in the running batch. Bad prompts raise
        ``ValueError`` here, before any of them is queued."""
        tokenized = [self.gen.tokenize(p, params) for p in prompts]
        futures = [Future() for _ in prompts]
        for (ids, truncated), fut in zip(tokenized, futures):
            self.submit_ids(ids, truncated, params, on_done=lambda r, fut=fut: fut.set_exception(r) if isinstance(
                r, BaseException) else fut.set_result(r))
        return [f.result() for f in futures]

    def swap(self, bank: Bank, version: str | None = None) -> None:
        """Route requests that start from now on with ``bank`` (for the same base model: the model is
        not reloaded); running ones keep their drafters. Applied on the batch's thread, before the
        next sequence starts."""
        with self._lock:
            self._pending = (bank, version, self.version if self._pending is None else self._pending[2])
            self.version = version  # what requests that start from now on are served by

    def _current(self) -> RoutedGenerator:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            bank, version, before = pending
            try:
                self.gen = RoutedGenerator(self.gen.lm, bank, plain=self.gen.plain)
                log.info("now routing new requests with bank version %s (%d clusters)", version, len(bank.clusters))
            except Exception:  # noqa: BLE001 - the running bank goes on serving
                log.exception("bank version %s could not be swapped in; the running bank goes on", version)
                with self._lock:
                    if self._pending is None:
                        self.version = before
        return self.gen

    def close(self) -> None:
        """Drop what waits, cancel what runs, and stop the thread."""
        with self._lock:
            for job in self._waiting:
                job.cancelled = True
        self._queue.close()
        self._thread.join(30)

    def _loop(self) -> None:
        while not self._queue.closed:
            self._scheduler = s = Scheduler(self.gen.decoder, self._queue, self.plan,  # type: ignore[union-attr]
                                            failed=lambda job, e: self._settle(job, e), on_step=self._on_step)
            try:
                for f in s.run():
                    self._settle(f.job, f.job.result(f.tokens, f.stats))
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error, the thread goes on
                log.exception("batched decoding failed; failing the requests in it")
                with self._lock:
                    waiting = list(self._waiting)
                for job in waiting:
                    self._settle(job, e)

    def _on_step(self, runs) -> None:
        s = self._scheduler
        for a in s.active:
            a.job.publish(a.run.new)
        if self.observer is not None:
            st = s.stats
            self.observer.step(st.pass_s[-1], st.active[-1], st.drafted[-1], st.emitted[-1])

    def _settle(self, job: StreamJob, outcome: Result | BaseException) -> None:
        with self._lock:
            if job not in self._waiting:
                return
            self._waiting.discard(job)
        if job.on_done is not None:
            job.on_done(outcome)


def serving_plan(gen: RoutedGenerator, slots: int | None, option: str, always: bool = False,
                 max_len: int | None = None) -> BatchPlan | None:
    """The running batch's plan over ``gen`` (``Batcher.routed``'s arguments), or None where it does not
    batch. With ``max_len`` no request reserves more positions, so the plan may put the batch on static
    slots (``RoutedGenerator.plan``: CUDA graphs on a GPU); without it, a request may reserve more than
    the default settings' positions, and the slots must be able to grow."""
    from knnssd.engine.batch.plan import auto_slots, check_slots

    if not gen.can_batch:
        return None
    d = GenerateParams()
    positions = max_len or min(d.max_prompt_tokens + d.max_new_tokens, gen.lm.limits.positions)
    n = slots
    if n is None:
        n = auto_slots(gen.decoder, positions, 1 << 10, record=gen.lm.batch_record)
    else:
        check_slots(gen.decoder, n, positions, option)
    return gen.plan(n, positions, bound=max_len is not None) if n > 1 or always else None
