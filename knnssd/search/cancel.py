"""Stopping searches that run in a flow's worker threads.

A flow's searches run in Prefect's thread pool. When the flow is interrupted (SIGTERM, which Prefect
turns into ``TerminationSignal`` in the main thread, or Ctrl-C), Prefect shuts the pool down and
waits for the threads it already started: a running search, and every search queued on the machine
lock behind it, would run to its end before the process exits. ``request()`` (``tasks.fanout``
calls it when a flow's wait is interrupted) makes each search stop at its next ``check()``: after
the trial or the timed prompt in progress, or while it waits for the machine lock. What the
studies hold stays in their storage, and a rerun resumes from it.
"""
from __future__ import annotations

import threading

_requested = threading.Event()  # process-wide: the threads to stop are this process's


class Cancelled(BaseException):
    """A search stopped because its flow was interrupted. Not an ``Exception``: nothing retries it, and
    handlers of errors (Optuna's failed trials among them) let it through."""


def request() -> None:
    _requested.set()


def reset() -> None:
    """Allow searches again (a flow that starts clears a request a previous one left behind)."""
    _requested.clear()


def requested() -> bool:
    return _requested.is_set()


def check() -> None:
    if _requested.is_set():
        raise Cancelled("the search was stopped: its flow was interrupted")
