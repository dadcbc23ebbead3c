"""When a failed task is worth retrying."""
from __future__ import annotations

import errno

# faults of the machine that a retry seconds later meets again: a full disk or quota, a read-only file system
LASTING = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG)


def transient(task, task_run, state) -> bool:
    """Retry unless the error is one a retry cannot change: a bad input (``ValueError`` and its
    subclasses: prompt, bank, mask, output and registry errors; MLflow's INVALID_PARAMETER_VALUE), a
    missing file, or a lasting fault (``LASTING``)."""
    try:
        state.result()
    except (ValueError, FileNotFoundError):
        return False
    except OSError as e:
        return e.errno not in LASTING
    except BaseException as e:  # noqa: BLE001 - anything else may be transient (I/O, a server restarting)
        return getattr(e, "error_code", None) != "INVALID_PARAMETER_VALUE"  # MLflow refusing a value: it will again
    return True
