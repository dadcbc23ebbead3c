"""Child processes that end with the command: the parent-death signal, and a process group stopped whole."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A preexec function for a child that the kernel stops (SIGTERM) when this thread's process dies.
    ``prctl`` is looked up here, in the parent: the child, between fork and exec, only calls it."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return preexec


def end_with_parent(what: str, poll_s: float = 0.5) -> None:
    """End this process, from a daemon thread, once the process that started it has ended. For a
    server under a launcher (``mlflow models serve`` execs uvicorn as its child): a SIGTERM to the
    group ends the launcher at once, while uvicorn's graceful shutdown waited for a request nobody
    would read, decoding it for 20-80 s."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"knnssd: {what}'s launcher (pid {parent}) has ended; stopping", file=sys.stderr, flush=True)
        os._exit(0)  # no request can be answered: its client went with the launcher

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies, which only wait to be reaped, are not)."""
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def stop_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """Stop ``proc``, the leader of a process group of its own (``start_new_session``), and the rest of its
    group: SIGTERM, then SIGKILL to what is left after ``grace_s`` (at once if this wait is interrupted)."""
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except OSError:  # nothing left (ProcessLookupError), or not ours to signal
                return
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.2)  # reaps the leader once it has exited
                if not group_members(proc.pid):
                    return
    except BaseException:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
