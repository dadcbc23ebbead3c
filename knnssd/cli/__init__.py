"""`knnssd ...` command line. Errors in inputs print one line and exit with status 2.

Each command is one ``command.Command``, declared where its handler is, with its options function beside
it, in a module of this package by group: ``demo``, ``generation``, ``serving``, ``calibration``,
``benches`` (each lists its ``COMMANDS``); what several take is in ``options``.
This module assembles the parser and runs a command: its signals, its log and its one-line errors.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import signal
import sys

# What every knnssd process runs with unless its environment says otherwise: local and quiet
ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true",
                "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
                # a tracking server that stops answering mid-run fails in seconds, not after minutes of retries
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15",
                "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
for _key, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

from knnssd.cli import benches, calibration, demo, generation, serving  # noqa: E402 - after the defaults above

GROUPS = (demo, generation, serving, calibration, benches)  # in the order `knnssd --help` lists them


class _Parser(argparse.ArgumentParser):
    """Usage errors in the one line every other error gets (argparse prints the usage first: 4-12 lines)."""

    def error(self, message: str):
        self.exit(2, f"knnssd: error: {message} (see: {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="knnssd", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true")
    # what a command uses MLflow for is set up before it runs; those that do not use it say so (mlflow=False)
    p.set_defaults(mlflow=True)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    for group in GROUPS:
        for command in group.COMMANDS:
            command.add(sub)
    p.commands = sub.choices  # each command's parser, for its own usage errors
    return p


UNWIND = (signal.SIGTERM, signal.SIGHUP)  # ``kill PID``, a scheduler's stop; the terminal closed


class Terminated(BaseException):
    """A signal of ``UNWIND``, raised in the main thread like Ctrl-C's KeyboardInterrupt, so the command
    unwinds as on Ctrl-C (an output's lock file is removed, servers and temporary folders are stopped and
    deleted) instead of ending where it stood."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)  # "Terminated: SIGHUP" where Prefect logs the crash
        self.signum = signum


@contextlib.contextmanager
def _signals_unwind():
    """While a command runs, each signal of ``UNWIND`` whose handler is the default raises ``Terminated``
    once (a second one ends the process at once, as before; an ignored signal or a host program's handler
    is left as it is, and so is every handler off the main thread). Within a flow Prefect's SIGTERM
    handler comes first (the run is marked Crashed), then sends the signal on to this one."""
    def terminated(signum, frame):
        signal.signal(signum, signal.SIG_DFL)
        raise Terminated(signum)

    installed = {}
    for sig in UNWIND:
        try:
            if signal.getsignal(sig) == signal.SIG_DFL:
                installed[sig] = signal.signal(sig, terminated)
        except ValueError:  # not the main thread
            break
    try:
        yield
    finally:
        for sig, before in installed.items():
            signal.signal(sig, before)


def main(argv: list[str] | None = None) -> int:
    from knnssd import console
    from knnssd.engine.model.skip import MaskError
    from knnssd.flows.server import PrefectUnavailable
    from knnssd.models import ModelError, resolve_device
    from knnssd.prompts import PromptError
    from knnssd.routing.bank import BankError
    from knnssd.serving.output_paths import OutputError
    from knnssd.settings import check_cache_dir, check_work_dir, graphs
    from knnssd.reachable import NoWorker
    from knnssd.tracking import RegistryError

    p = parser()
    a, extra = p.parse_known_args(argv)
    if extra:  # named with the command's own --help, which lists what it takes
        p.commands[a.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    with _signals_unwind():
        try:
            check_work_dir()  # where the log file goes, before anything is written there
            check_cache_dir()  # where a first load converts the model and builds the kernels
            console.setup(a.verbose)
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            if a.mlflow:
                console.adopt_library_loggers()
            if getattr(a, "device", None) is not None:  # every command that loads a model takes --device:
                graphs(resolve_device(a.device))  # a bad one (or $KNNSSD_GRAPHS) fails here, before
                # any server starts or model loads
            return a.fn(a)
        except (ModelError, PromptError, MaskError, BankError, RegistryError, OutputError, ValueError,
                FileNotFoundError, PrefectUnavailable, NoWorker) as e:
            return _error(e)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise
            return _error(f"{e.strerror}{f' ({e.filename})' if e.filename else ''}; what was finished is kept: make "
                          "room (or make it writable) and run the same command again")
        except KeyboardInterrupt:
            console.end_progress()
            print("knnssd: interrupted", file=sys.stderr)
            return 130
        except Terminated as e:
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                console.end_progress()
                print(f"knnssd: terminated ({e})", file=sys.stderr)
            return 128 + e.signum
        except Exception as e:
            if not _is_mlflow_error(e):
                raise
            return _error(f"MLflow: {console.first_line(e)}")


def _error(e) -> int:
    """The one line a bad input or a fault gets (the traceback, where there is one, goes to the log file)."""
    import logging

    from knnssd import console

    logging.getLogger("knnssd").info("the error's traceback", exc_info=True)
    console.end_progress()
    errors = getattr(e, "errors", None)  # pydantic's ValidationError: a line per field and its input
    if callable(errors) and type(e).__name__ == "ValidationError":
        first = errors()[0]
        if first["type"] == "value_error":  # a validator's own message, which names what it got
            e = f"{'.'.join(map(str, first['loc']))}: {first['msg'].removeprefix('Value error, ')}"
        else:
            e = f"{'.'.join(map(str, first['loc']))}: {first['msg']} (got {first.get('input')!r})"
    print(f"knnssd: error: {e}", file=sys.stderr)
    return 2


def _is_mlflow_error(e: Exception) -> bool:
    """The tracking store failed under a command (a database that filled up or was damaged mid-run)."""
    mlflow_exceptions = sys.modules.get("mlflow.exceptions")
    return mlflow_exceptions is not None and isinstance(e, mlflow_exceptions.MlflowException)
