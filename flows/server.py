"""The Prefect API a command's flows use: checked, or started so that it dies with the command.

With ``PREFECT_API_URL`` set, its ``/health`` must answer within ``TIMEOUT_S`` or the command
stops with a one-line error. Without it, Prefect would start a temporary server (a uvicorn
child) that outlives a SIGKILLed parent and keeps its port; ``local_api()`` starts that same
server itself, with the kernel's parent-death signal set, so it stops with the command however
the command ends.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from knnssd import reachable, shims

TIMEOUT_S = 5
STARTUP_S = 90  # the least a temporary server gets to answer: a fresh PREFECT_HOME's database is created and
# migrated first, which can take longer than Prefect's default 20 s on a small loaded machine


class PrefectUnavailable(RuntimeError):
    """The Prefect API does not answer; one line."""


def check(url: str) -> None:
    reason = reachable.error(url.rstrip("/") + "/health", TIMEOUT_S)
    if reason is not None:
        raise PrefectUnavailable(f"Prefect API {url} does not answer within {TIMEOUT_S} s ({reason})")


@contextlib.contextmanager
def local_api() -> Iterator[str]:
    """Yield the API URL flows will use: ``PREFECT_API_URL`` once it answers, else a temporary server
    of this process's own (call it from the main thread: the parent-death signal follows the thread
    that started the server)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings

    url = PREFECT_API_URL.value()
    if url:
        check(url)
        yield url
        return
    # its own port: never an instance Prefect made without the signal
    server = shims.prefect_server_class()(reachable.free_port())
    try:
        server.start(timeout=max(STARTUP_S, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()))
    except BaseException as e:  # a start timeout, a port race, Ctrl-C or SIGTERM: nothing left running
        server.stop()
        if not isinstance(e, Exception):
            raise
        raise PrefectUnavailable(f"the temporary Prefect server did not start ({str(e).splitlines()[0][:200]})") from None
    try:
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield server.api_url
            finally:
                drain()
    finally:
        server.stop()


def drain(timeout: float = 10) -> None:
    """Deliver the logs and events Prefect still holds while the server answers: at interpreter exit,
    its workers would otherwise retry a stopped server with backoff, for a minute or more."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout)
        except Exception:  # noqa: BLE001 - best effort: nothing to deliver is not an error
            pass
