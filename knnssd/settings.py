"""Every default path and URI knnssd uses, in one place (each can be set by an environment variable).

    work_dir()      $KNNSSD_WORK, else ./artifacts: banks, logs, studies, prefill vectors, the
                    default tracking database
    cache_dir()     $KNNSSD_CACHE, else ~/.cache/knnssd: converted models and what the
                    exactness probe measured on this machine (shared by every work folder)
    tracking_uri()  $MLFLOW_TRACKING_URI, else sqlite:///<work_dir>/mlflow.db (``default_tracking_uri``)

``check_work_dir`` says in one line why the work folder cannot be used. ``graphs`` reads
``$KNNSSD_GRAPHS``: whether generation runs on the static step (CUDA graphs); ``isa``, ``$KNNSSD_ISA``: the
instruction-set level the native kernels are built for.
"""
from __future__ import annotations

import os
from pathlib import Path

# What --dtype and $KNNSSD_DTYPE take: auto (bf16 on CUDA and where the native bf16 step runs, else fp32), bf16, fp32,
# or weights in blocks (``BLOCKS``), each a precision of its own with bf16 activations (``engine.model.quantized``)
BLOCKS = ("gguf", "q4_1", "q8_0")  # a GGUF model's own blocks; any model's weights quantized at load
DTYPES = ("auto", "bfloat16", "float32", *BLOCKS)
DTYPE_HELP = ("auto (bf16 where the CPU or GPU runs it fast, else fp32) | bfloat16 | float32 | gguf (a GGUF file's "
              "own blocks) | q4_1 | q8_0 (blocks made at load)")  # --dtype's help, the CLI's and the benchmarks'
# What $KNNSSD_GRAPHS takes: whether generation runs the static step, replayed from CUDA graphs
# (``engine.static.graphs``): auto (on CUDA, where kernel launches set a step's time), on (any device; on the CPU it
# runs eagerly, slower than the native kernels: for tests), off
GRAPHS = ("auto", "on", "off")


def graphs(device, value: str | None = None) -> bool:
    """Whether generation on ``device`` (a ``torch.device``) runs the static step: ``value``, else
    ``$KNNSSD_GRAPHS``, default auto. A value not in ``GRAPHS`` raises a one-line ``ValueError``."""
    value = value or os.environ.get("KNNSSD_GRAPHS") or "auto"
    if value not in GRAPHS:
        raise ValueError(f"KNNSSD_GRAPHS={value!r} is not one of {', '.join(GRAPHS)}")
    return value == "on" or value == "auto" and device.type == "cuda"


def isa() -> str | None:
    """``$KNNSSD_ISA``: the instruction-set level the native kernels are built for (a ``-march`` value such as
    ``x86-64-v3``), to run a lesser level's kernels on a machine that has more; None (unset or empty): the
    machine's own (``-march=native``)."""
    return os.environ.get("KNNSSD_ISA") or None


def work_dir() -> Path:
    return Path(os.environ.get("KNNSSD_WORK") or Path.cwd() / "artifacts")  # set but empty: the default too


def cache_dir() -> Path:
    return Path(os.environ.get("KNNSSD_CACHE") or Path.home() / ".cache" / "knnssd")


def default_tracking_uri() -> str:
    return f"sqlite:///{work_dir() / 'mlflow.db'}"


def tracking_uri(given: str | None = None) -> str:
    """The tracking URI an option gave, else ``$MLFLOW_TRACKING_URI``, else the default. An empty one is
    kept, for ``tracking.check_reachable`` to refuse: it once fell back to the default unsaid."""
    if given is not None:
        return given
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri()


def check_work_dir() -> None:
    """A one-line ``ValueError`` when the work folder is not a folder this process can create and write."""
    path = work_dir()
    if path.exists() and not path.is_dir():
        raise ValueError(f"work folder {path} is a file, not a folder (set KNNSSD_WORK to a folder)")
    _check_writable(path, "work folder", "KNNSSD_WORK")


def check_cache_dir() -> None:
    """A one-line ``ValueError`` when the cache folder holds nothing yet and cannot be made or written: the
    first model load converts and compiles into it (a read-only one gave a warning, then an error that spoke
    of room to make: trial 6, D7). A cache made beforehand may be read-only: it is not written again."""
    path = cache_dir()
    if path.is_dir() and any(path.iterdir()):
        return
    _check_writable(path, "cache folder", "KNNSSD_CACHE")


def _check_writable(path: Path, what: str, variable: str) -> None:
    """``path`` made if missing and written in, or a one-line ``ValueError`` naming ``variable`` (tested by
    writing, not by permission bits: root passes those on a read-only file system)."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be written ({e.strerror or e}); set {variable} to a "
                         "writable folder") from None
