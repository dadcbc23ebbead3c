"""When a failed task is worth retrying."""
from __future__ import annotations


def transient(task, task_run, state) -> bool:
    """Retry unless the error is one a retry cannot change: a bad input (``ValueError`` and its
    subclasses: prompt, bank, mask, output and registry errors) or a missing file."""
    try:
        state.result()
    except (ValueError, FileNotFoundError):
        return False
    except BaseException:  # noqa: BLE001 - anything else may be transient (I/O, a server restarting)
        return True
    return True
