"""One task over many inputs, from a flow, in Prefect's thread pool: the results in order, and an
interrupted flow stops the runs still going (``search.cancel``) instead of waiting for them."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from knnssd.search import cancel


def run_all(task, calls: Sequence[tuple[Any, ...]]) -> list:
    """``task.submit(*args)`` for each ``args`` of ``calls``; returns their results in order. If the wait
    is interrupted (SIGTERM, which Prefect raises in the main thread as ``TerminationSignal``, or
    Ctrl-C), the searches still running or queued on the machine lock stop at their next check, so
    the process exits within a trial instead of after every search already started. A failed run
    stops nothing: the others finish, and their results are cached for the rerun."""
    cancel.reset()
    try:
        futures = [task.submit(*args) for args in calls]
        return [f.result() for f in futures]
    except BaseException as e:
        if not isinstance(e, Exception):
            cancel.request()
        raise
