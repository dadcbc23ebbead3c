"""The private APIs of pinned libraries that knnssd relies on, each behind one small shim with a guard.

Each shim checks what it leans on (the library's version, the names it reaches into) and, where that
is not what it was written against, logs once and leaves the library's own behaviour in place, so a
new release degrades a feature instead of failing a run. ``tests/test_shims.py`` fails loudly on the
pinned versions when one of them changes.

- ``prefect_server_class``: Prefect's temporary API server, started as a child that dies with the
  command (``SubprocessASGIServer._run_uvicorn_command``, private in prefect 3.8.8).
- ``widen_this_executor``: let the ``ThreadPoolExecutor`` whose worker runs the caller start more
  threads (CPython's ``concurrent.futures.thread._worker`` frame, its ``executor_reference`` local and
  the executor's ``_max_workers``), so that ``mlflow models serve`` may run as many ``predict`` calls at
  once as a batch has slots.
- ``gguf_parsed_once``: while a GGUF file is converted, read its header once and build each tensor-name
  map once (transformers 5.23.0 calls ``gguf.GGUFReader`` on the file three times, for the config, the
  tokenizer and the weights, and ``gguf.get_tensor_name_map`` once per module, each parse the same).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from knnssd.processes import die_with_parent

log = logging.getLogger(__name__)

PREFECT_VERSION = "3.8.8"  # pyproject.toml's pin, which ``prefect_server_class`` was written against
TRANSFORMERS_VERSION = "5.23.0"  # pyproject.toml's pin, whose GGUF loading ``gguf_parsed_once`` was written against
PYTHONS = ((3, 10), (3, 11), (3, 12), (3, 13))  # whose thread pools ``executor_of_this_thread`` reads


@functools.cache
def prefect_server_class() -> type:
    """Prefect's temporary server class; on the pinned version, one whose uvicorn child gets the kernel's
    parent-death signal and a session of its own (a stop sent to the command's whole group reaches the
    command, which reports its flow's state to the server and then stops it). Elsewhere Prefect's own."""
    import prefect
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    if prefect.__version__ != PREFECT_VERSION or not callable(getattr(SubprocessASGIServer, "_run_uvicorn_command", None)):
        log.warning("prefect %s is not the %s knnssd was written against: its temporary server runs as Prefect "
                    "starts it, and may outlive a killed command", prefect.__version__, PREFECT_VERSION)
        return SubprocessASGIServer

    class Server(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}
            args = [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                    "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "error", "--lifespan", "on"]
            return subprocess.Popen(args, env=env, preexec_fn=die_with_parent(), start_new_session=True)

    return Server


def widen_this_executor(workers: int) -> bool:
    """Where the caller runs on a ``ThreadPoolExecutor``'s worker thread, let that executor start up to
    ``workers`` threads (never fewer than it may now); True where it did. False elsewhere, or on a Python
    whose thread pools this was not written against."""
    if sys.version_info[:2] not in PYTHONS:
        return False
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "_worker" and "executor_reference" in frame.f_locals):
        frame = frame.f_back
    executor = frame.f_locals["executor_reference"]() if frame is not None else None
    if not isinstance(executor, ThreadPoolExecutor) or not isinstance(getattr(executor, "_max_workers", None), int):
        return False
    executor._max_workers = max(executor._max_workers, workers)
    return True


_GGUF_PATCH = threading.Lock()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[bool]:
    """Within the block, ``gguf.GGUFReader`` of a path already read returns the same (read-only) reader, and
    ``gguf.get_tensor_name_map`` its map for the same architecture and depth; the library's own functions
    come back after (a block in another thread waits for this one). Yields True where it did; False (and a
    log line) on a transformers release other than the pinned one, which may read the file otherwise: the
    conversion then runs as the library runs it."""
    import gguf
    import transformers

    if transformers.__version__ != TRANSFORMERS_VERSION or not all(
            callable(getattr(gguf, n, None)) for n in ("GGUFReader", "get_tensor_name_map")):
        log.warning("transformers %s is not the %s knnssd was written against: a GGUF file is converted as it "
                    "converts it (slower)", transformers.__version__, TRANSFORMERS_VERSION)
        yield False
        return
    with _GGUF_PATCH:  # a block in another thread meanwhile would save the stand-ins as the originals
        reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple, object] = {}

        def read_once(path, mode="r"):
            key = (os.fspath(path), mode)
            if mode != "r":  # a writable map is not shared
                return reader(path, mode)
            if key not in readers:
                readers[key] = reader(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = read_once, functools.cache(name_map)
        try:
            yield True
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
