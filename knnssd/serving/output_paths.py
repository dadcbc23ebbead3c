"""An output file's paths (the parquet, its progress journal and its lock file), the checks made on them
before anything is written (``output_path``, ``check_paths``, each failure an ``OutputError`` of one
line), and the lock that lets one process at a time write an output (``writing``)."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from knnssd import locks


class OutputError(ValueError):
    """The output path cannot be used; one line."""


class ShardFailed(OutputError):
    """A shard of a sharded run failed for good, so the output is not written; one line naming the shard
    and why (its part is kept for the rerun)."""


def progress_path(output: Path) -> Path:
    return output.with_name(output.name + ".progress.jsonl")


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


SUFFIXES = (".parquet", ".pq")


def output_path(output: str | os.PathLike) -> Path:
    """Where an output is written: the file a symbolic link names (replacing the link by the new file
    would leave its target stale), else the path as given."""
    output = Path(output)
    try:
        return output.resolve() if output.is_symlink() else output
    except OSError:  # a name too long to look up: ``check_paths`` says so
        return output


def check_paths(output: Path, inputs=()) -> None:
    """``output`` can be written as a parquet file (a regular file or none yet, named ``.parquet``),
    and is none of ``inputs`` (nor is its journal or lock file): by the same path, a symbolic link or a
    hard link. An ``--overwrite`` would otherwise replace the prompts with the answers."""
    output = Path(output)
    _check_name(output)
    if output.is_dir():
        raise OutputError(f"{output} is a folder; give a .parquet file path")
    for inp in inputs:
        if str(inp).startswith("hf:"):
            continue
        for own in (output, progress_path(output), lock_path(output)):
            if _same_file(Path(inp), own):
                what = "" if own == output else f" (its {own.name[len(output.name):]} file)"
                other = Path(inp).with_name(f"{Path(inp).stem}.generated.parquet")
                raise OutputError(f"--output {output}{what} is the input file {inp}; writing it would destroy the "
                                  f"prompts: choose another path, such as {other}")
    if output.exists() and not output.is_file():  # /dev/null, a FIFO: --overwrite would replace a device node
        raise OutputError(f"{output} is not a regular file; give a .parquet file path")
    if output.suffix.lower() not in SUFFIXES:
        raise OutputError(f"--output {output} does not name a .parquet file; the output is written as parquet")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): only the same path is the same file
        return a.resolve() == b.resolve()


JOURNAL_SUFFIX = ".progress.jsonl"  # the longest name written beside the output


def _check_name(output: Path) -> None:
    """A one-line error for a name the file system cannot hold with its journal's suffix (it failed
    with a traceback where the file was first touched), under a file where a folder should be, or in a
    folder that does not exist (a mistyped folder was made, and the model loaded and ran, where a mistyped
    storage or tracking path is refused: trial 6, D4)."""
    parent = folder = output.absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():  # the lock file's creation said only "File exists"
        raise OutputError(f"--output {output}: {folder} is a file, not a folder")
    if folder != parent:
        raise OutputError(f"--output {output}: the folder {parent} does not exist; make it first, or give a path in "
                          "a folder that exists")
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    size = len(os.fsencode(output.name))
    if size + len(JOURNAL_SUFFIX) > name_max:
        raise OutputError(f"output file name is too long ({size} bytes; at most {name_max - len(JOURNAL_SUFFIX)} "
                          f"here, to leave room for its {JOURNAL_SUFFIX} journal)")


_held: dict[Path, int] = {}  # outputs this process holds: lock file descriptor


@contextlib.contextmanager
def writing(output: str | os.PathLike) -> Iterator[None]:
    """Hold ``<output>.lock`` while writing ``output``: a second writer (another process) fails at once
    with an ``OutputError`` naming the holder. The lock is an ``flock``, so the kernel releases it on
    any exit, SIGKILL included; the file itself is removed on a normal exit. Re-entrant in a process."""
    output = Path(output).resolve()
    if output in _held:
        yield
        return
    path = lock_path(output)
    fd = _lock(path)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    except OSError as e:  # a full disk
        path.unlink(missing_ok=True)
        os.close(fd)
        raise OutputError(f"cannot write the lock file {path} ({e.strerror or e})") from None
    _held[output] = fd
    try:
        yield
    finally:
        del _held[output]
        path.unlink(missing_ok=True)  # while still holding it: a waiter then finds its file gone and retries
        os.close(fd)


def _lock(path: Path) -> int:
    """An fd holding ``flock`` on the file now at ``path`` (not one a finishing holder just unlinked)."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot create the lock file {path} ({e.strerror or e})") from None
        if not _try_lock(fd):
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            output = path.with_name(path.name[: -len(".lock")])
            raise OutputError(f"{output} is being written by process {holder}; wait for it or choose another "
                              "--output") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


PROBE_S = 0.5  # a sharded run's watch (``held``) holds a part's lock for microseconds at a time


def _try_lock(fd: int) -> bool:
    """The lock now, or within ``PROBE_S``: a watch's look is not a writer."""
    deadline = time.monotonic() + PROBE_S
    while not locks.try_lock(fd):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def held(output: str | os.PathLike) -> bool:
    """Is ``output`` being written now, by a process anywhere that shares its folder (``writing``)? Only
    looks: the lock is taken and dropped at once, and its file is left as it is."""
    try:
        fd = os.open(lock_path(Path(output)), os.O_RDONLY)
    except OSError:  # no lock file: no writer
        return False
    try:
        return not locks.try_lock(fd)
    finally:
        os.close(fd)  # drops the lock, if this took it
