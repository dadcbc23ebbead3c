"""File locks between processes: ``flock``, which the kernel releases when its holder exits however it
ends (SIGKILL included), so a killed process never leaves a lock that blocks the next run.

``locked`` holds a lock for a block of code: blocking, or polling with a callback between tries (a
search waiting for the machine stops when its flow is cancelled). ``try_lock`` takes one at once or
says it is held (an output's second writer fails at once, naming the holder).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

POLL_S = 0.2


def try_lock(fd: int) -> bool:
    """Take the exclusive lock on ``fd`` now; False where another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextlib.contextmanager
def locked(path: Path, poll: Callable[[], None] | None = None) -> Iterator[int]:
    """Hold the exclusive lock on ``path`` (a file, made if missing, its folder too; or a folder, which
    leaves no lock file behind), and yield its fd. Without ``poll``, wait for it; with ``poll``, try
    every ``POLL_S`` seconds and call ``poll`` between tries (it raises to stop waiting)."""
    path = Path(path)
    if path.is_dir():
        fd = os.open(path, os.O_RDONLY)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if poll is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            while not try_lock(fd):
                poll()
                time.sleep(POLL_S)
        yield fd
    finally:
        os.close(fd)  # releases the lock
