"""C kernels for the CPU step (``native.c``), built at first use with the system's C compiler.

A torch op costs a few microseconds of dispatch on the CPU whatever its size. RMSNorm is about
eight of them (F.rms_norm's composite: upcast, square, mean, add, rsqrt, two products, downcast)
and RoPE four (two products, a roll, a sum). A one-token step of SmolLM2 runs 61 norms of one
576-wide row and 30 RoPEs: in torch ops they cost about 2 ms of its 20 (bf16, 2-core Zen 4); one
C call each costs about 2.5 us (norm) and 4.5 us (RoPE), Python included.

Each kernel computes every row alone with one fixed loop (``native.c``), so its rows do not depend
on the call's row count (the exactness probe still measures the whole step). The library is built
once per source, compiler and processor (``-march=native``) into ``cache_dir()/native``; with no C
compiler, or ``KNNSSD_NATIVE=0``, ``library()`` is None and callers keep the torch ops.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
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
    for stale in folder.glob(".build-*"):  # left by a build that was killed (a build takes about a second)
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 600:
                stale.unlink()
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
        log.info("no C compiler (cc): the step's norms and RoPE run as torch ops")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the native kernels (%s): the step's norms and RoPE run as torch ops",
                    str(detail)[-300:])
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for names, args in ((("rms_norm_bf16", "rms_norm_f32"), (ptr, ptr, ptr, i64, i64, ctypes.c_float)),
                        (("rope_bf16", "rope_f32"), (ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64))):
        for name in names:
            f = getattr(lib, name)
            f.restype, f.argtypes = None, list(args)
    return lib


def available() -> bool:
    return library() is not None


class RMSNorm:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in fp32 and rounded once to x's
    dtype (what ``F.rms_norm`` computes, for a weight of either dtype), for CPU tensors in bf16 or fp32.
    ``of`` returns None where the kernels are not built or the weight is not on the CPU. (The calls
    stay lean: at one row, the C work is well under a microsecond of their ~2.)"""

    def __init__(self, lib: ctypes.CDLL, weight: torch.Tensor, eps: float):
        self.weight = weight.detach().float().contiguous()  # the kernels read an fp32 weight
        self.n, self.eps, self.weight_ptr = self.weight.numel(), eps, self.weight.data_ptr()
        self.kernels = {torch.bfloat16: lib.rms_norm_bf16, torch.float32: lib.rms_norm_f32}

    @classmethod
    def of(cls, weight: torch.Tensor, eps: float) -> "RMSNorm | None":
        lib = library() if weight.is_cpu else None
        return cls(lib, weight, eps) if lib is not None else None

    def __reduce__(self):  # copies and pickles load the library again (ctypes functions cannot be pickled)
        return RMSNorm.of, (self.weight, self.eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The norm of x, or None for a dtype or device the kernels do not take."""
        kernel = self.kernels.get(x.dtype)
        if kernel is None or not x.is_cpu or x.shape[-1] != self.n:
            return None
        if not x.is_contiguous():  # e.g. a q-norm's heads, sliced from QKV rows: the same values, copied
            x = x.contiguous()
        out = torch.empty_like(x)
        kernel(x.data_ptr(), self.weight_ptr, out.data_ptr(), x.numel() // self.n, self.n, self.eps)
        return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor | None:
    """``skip._rope`` in one call: x (T, heads, D) with contiguous heads (a slice of QKV rows), cos and
    sin_signed (T, 1, d) of x's dtype -> a new contiguous (T, heads, D); None where the kernels do not apply."""
    lib = library()
    if lib is None or not x.is_cpu or cos.dtype != x.dtype or sin_signed.dtype != x.dtype:
        return None
    kernel = lib.rope_bf16 if x.dtype == torch.bfloat16 else lib.rope_f32 if x.dtype == torch.float32 else None
    T, heads, D = x.shape
    d = cos.shape[-1]
    if kernel is None or x.stride(2) != 1 or x.stride(1) != D or d % 2 or not (cos.is_contiguous()
                                                                             and sin_signed.is_contiguous()):
        return None
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel(x.data_ptr(), x.stride(0), cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr(), T, heads, D, d)
    return out
