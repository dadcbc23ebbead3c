"""Concurrent requests decoded together: one thread runs a continuous batch (``engine.batched``) over
a queue; each request puts its prompts in and waits for its own results.

A request that arrives while others are decoding joins the running batch at the next free slot,
so 16 requests at once take about as many full-model passes as the longest of them needs, instead
of 16 times as many. Where the packed passes are exact (``BatchPlan.exact``), every answer equals
its one-at-a-time generation.

The batch's thread also loads the model: all the engine's torch work runs on that one thread. Torch's
CPU threads are OpenMP's, and OpenMP keeps a pool of worker threads for each thread that runs
parallel work; once two pools are alive (the loading thread's and the batch's) there are more OpenMP
threads than cores on a small machine, and libgomp stops letting idle workers spin, which slowed
every step of the batch's thread (docs/benchmarks.md).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

from knnssd.engine.batch_plan import BatchPlan
from knnssd.engine.batched import JobQueue, decode_batch
from knnssd.engine.params import GenerateParams
from knnssd.serving.routed import Result, RoutedGenerator, RoutedJob

log = logging.getLogger(__name__)


class Batcher:
    """``load`` runs on the batch's thread and returns the generator and the batch's plan (None: the
    generator cannot batch, or one slot was asked for; the thread then ends, and ``generate`` is not
    used). The constructor returns once it has, raising what it raised."""

    def __init__(self, load: Callable[[], tuple[RoutedGenerator, BatchPlan | None]]):
        self.gen: RoutedGenerator | None = None
        self.plan: BatchPlan | None = None
        self._queue = JobQueue()
        self._waiting: set[Future] = set()
        self._lock = threading.Lock()
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

    def generate(self, prompts: list[str], params: GenerateParams) -> list[Result]:
        """Results for ``prompts`` in their order, decoded in the running batch. Bad prompts raise
        ``ValueError`` here, before any of them is queued."""
        jobs = [RoutedJob(self.gen, *self.gen.tokenize(p, params), params, Future()) for p in prompts]
        with self._lock:
            self._waiting.update(j.key for j in jobs)
        for j in jobs:
            self._queue.put(j)
        return [j.key.result() for j in jobs]

    @property
    def batching(self) -> bool:
        return self.plan is not None

    def close(self) -> None:
        """Finish what is queued, then stop the thread."""
        self._queue.close()
        self._thread.join()

    def _loop(self) -> None:
        while not self._queue.closed:
            try:
                for f in decode_batch(self.gen.decoder, self._queue, self.plan,  # type: ignore[union-attr]
                                      failed=lambda job, e: self._settle(job.key, error=e)):
                    self._settle(f.job.key, result=f.job.result(f.tokens, f.stats))
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error, the thread goes on
                log.exception("batched decoding failed; failing the requests in it")
                with self._lock:
                    waiting = list(self._waiting)
                for fut in waiting:
                    self._settle(fut, error=e)

    def _settle(self, fut: Future, result: Result | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            if fut not in self._waiting:
                return
            self._waiting.discard(fut)
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
