"""C kernels for the CPU step (``native.c``), built at first use with the system's C compiler.

A torch op costs a few microseconds of dispatch on the CPU whatever its size, and RMSNorm is about
eight of them (F.rms_norm's composite: upcast, square, mean, add, rsqrt, two products, downcast).
A one-token step of SmolLM2 runs 61 norms of one 576-wide row: in the step they cost about 2 ms of
its 20 (bf16, 2-core Zen 4), and one C call does each in about 2.5 us.

Each kernel computes every row alone with one fixed loop (``native.c``), so its rows do not depend
on the call's row count (the exactness probe still measures the whole step). The library is built
once per source, compiler and processor (``-march=native``) into ``cache_dir()/native``; with no C
compiler, or ``KNNSSD_NATIVE=0``, ``library()`` is None and callers keep the torch ops.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from knnssd.settings import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")  # no fused multiply-add: torch's rounding


def _processor() -> str:
    try:
        return "".join(sorted({l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")}))
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    """The shared library for this source, compiler and processor, compiled unless already there (written
    to a temporary name and renamed, so a killed or concurrent build never leaves a partial library)."""
    key = hashlib.sha256(b"|".join((SOURCE.read_bytes(), compiler.encode(), " ".join(FLAGS).encode(),
                                    platform.machine().encode(), _processor().encode()))).hexdigest()[:16]
    folder = cache_dir() / "native"
    path = folder / f"knnssd-{key}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, a failed build, or ``KNNSSD_NATIVE=0``): said once."""
    if os.environ.get("KNNSSD_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (cc): the step's norms run as torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the native kernels (%s): the step's norms run as torch ops", str(detail)[-300:])
        return None
    for name, elem in (("rms_norm_bf16", ctypes.c_uint16), ("rms_norm_f32", ctypes.c_float)):
        f = getattr(lib, name)
        f.restype = None
        f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_float]
    return lib


def available() -> bool:
    return library() is not None


class RMSNorm:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32 and rounded once to x's
    dtype (what ``F.rms_norm`` computes, for a weight of either dtype), for CPU tensors in bf16 or fp32.
    ``of`` returns None where the kernels are not built or the weight is not on the CPU."""

    KERNELS = {torch.bfloat16: "rms_norm_bf16", torch.float32: "rms_norm_f32"}

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, eps: float):
        self.weight = weight.detach().float().contiguous()  # the kernels read an fp32 weight
        self.eps = eps
        self.kernels = {dtype: getattr(lib, name) for dtype, name in self.KERNELS.items()}

    @classmethod
    def of(cls, weight: torch.Tensor, eps: float) -> "RMSNorm | None":
        lib = library() if weight.device.type == "cpu" else None
        return cls(lib, weight, eps) if lib is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The norm of x, or None for a dtype or device the kernels do not take."""
        kernel = self.kernels.get(x.dtype)
        n = x.shape[-1]
        if kernel is None or x.device.type != "cpu" or n != self.weight.numel():
            return None
        rows = x.reshape(-1, n)  # a copy only for a layout that cannot be viewed so (same values either way)
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != n):
            rows = rows.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        kernel(rows.data_ptr(), self.weight.data_ptr(), out.data_ptr(), rows.shape[0], n, self.eps)
        return out
