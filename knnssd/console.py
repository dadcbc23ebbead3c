"""What a command shows: its own progress and results, warnings and errors; the rest goes to a file.

Everything (knnssd, Prefect, MLflow, Python warnings) is written at INFO to
``<work>/logs/knnssd.log``. The terminal gets WARNING and above, without Python warnings, or
everything with ``-v``. MLflow gives its loggers a terminal handler of their own at import; they
are sent through the same two handlers instead. Prefect leaves the root handlers alone once they exist.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
from pathlib import Path

from knnssd.settings import work_dir

FORMAT = "%(levelname)s %(name)s: %(message)s"
_LIBRARY_LOGGERS = ("mlflow", "alembic", "sqlalchemy.engine", "huey")


class _NoPythonWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != "py.warnings"


class _NoRunFailures(logging.Filter):
    """Prefect's own report of a failed task or flow run (its exception, traceback and final state, again
    for each retry): the command says what failed in one line as the exception reaches it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.name in ("prefect.task_runs", "prefect.flow_runs"))


class _File(logging.FileHandler):
    """The log file; a write that fails (a full disk) says so once on stderr, then stops writing it
    instead of printing logging's traceback for every record."""

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        logging.getLogger().removeHandler(self)
        with contextlib.suppress(Exception):
            self.close()
        print(f"knnssd: warning: the log file {self.baseFilename} cannot be written ({getattr(err, 'strerror', err)});"
              " logging to it stops", file=sys.stderr)


def setup(verbose: bool) -> Path:
    """Route logging as above; returns the log file."""
    path = work_dir() / "logs" / "knnssd.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    terminal = logging.StreamHandler()
    terminal.setLevel(logging.INFO if verbose else logging.WARNING)
    terminal.setFormatter(logging.Formatter(FORMAT))
    if not verbose:
        terminal.addFilter(_NoPythonWarnings())
        terminal.addFilter(_NoRunFailures())
    file = _File(path, encoding="utf-8")
    file.setLevel(logging.INFO)
    file.setFormatter(logging.Formatter("%(asctime)s " + FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [terminal, file]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    for name in ("transformers", "urllib3", "httpx", "httpcore", "filelock", "faiss"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return path


def adopt_library_loggers() -> None:
    """Send MLflow's loggers (configured when mlflow is imported) through the root handlers."""
    import mlflow  # noqa: F401 - configures its loggers

    for name in _LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = []
        logger.propagate = True


class _LogLines(io.TextIOBase):
    def __init__(self, logger: logging.Logger, stream):
        self.logger, self.stream = logger, stream
        self.inside = threading.local()

    def write(self, text: str) -> int:
        if getattr(self.inside, "on", False):  # a handler that writes to sys.stderr: the real stream
            return self.stream.write(text)
        self.inside.on = True
        try:
            for line in text.splitlines():
                if line.strip():
                    self.logger.info(line.strip())
        finally:
            self.inside.on = False
        return len(text)


@contextlib.contextmanager
def stderr_to_log(name: str):
    """What a library prints straight to stderr (MLflow's "Successfully registered model ..."), logged
    at INFO under ``name`` instead (a handler that itself writes to sys.stderr gets the real stream)."""
    with contextlib.redirect_stderr(_LogLines(logging.getLogger(name), sys.stderr)):
        yield


def end_progress() -> None:
    """Close the progress bars a failure or a signal left open (a cancelled search's), so the command's
    last line starts a line of its own instead of trailing a bar."""
    module = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(module, "tqdm", None), "_instances", ())):
        with contextlib.suppress(Exception):
            bar.close()


def first_line(error: BaseException) -> str:
    """An exception's first non-empty line (MLflow's and SQLAlchemy's run to many), else its type's name."""
    text = str(getattr(error, "message", None) or error)
    return next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
