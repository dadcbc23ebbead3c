"""Building and loading ``native.c``'s library, once per machine, with the system's C compiler.

The library is built once per source, compiler and processor (``-march=native``, or the level
``$KNNSSD_ISA`` names: ``isa_flags``) into ``cache_dir()/native``; with no C compiler, or
``KNNSSD_NATIVE=0``, ``library()`` is None and callers keep the torch ops.
Which kernels a library has, and which of them a step is to use here, is decided once a process
(``library``, ``tiled``, ``linear_preferred``): the kernels themselves are ``native``'s.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from knnssd.settings import cache_dir, isa

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-ffp-contract=off", "-shared", "-fPIC")  # no fused multiply-add: torch's rounding
SIGNATURES = {  # the kernel families native.c defines (``<family>_bf16``, ``<family>_f32``) and their arguments
    # x, w (fp32), out, rows, n, eps
    "rms_norm": ("p", "p", "p", "i", "i", "f"),
    # x, x's token stride, cos, sin, out, T, heads, D, d
    "rope": ("p", "i", "p", "p", "p", "i", "i", "i", "i"),
    # q, q's row stride, k, v, slots in the cache, slot stride, L, head stride, slots, pos, out, rows, H, KV, D,
    # window, scale, scratch, its floats per thread, threads; returns 0, or -1 for a row outside the cache
    "attention": ("p", "i", "p", "p", "i", "i", "i", "i", "p", "p", "p", "i", "i", "i", "i", "i", "f", "p", "i", "i"),
    # x, x's row stride, packed weight, bias (fp32, or null), out, M, K, N, threads; returns 0, or -1 (not built
    # for this dtype or processor, or a shape it does not take)
    "linear": ("p", "i", "p", "p", "p", "i", "i", "i", "i"),
    # the same with int8 weights: x, x's row stride, packed weight, scales (fp32), bias, out, M, K, N, threads
    "linear_int8": ("p", "i", "p", "p", "p", "p", "i", "i", "i", "i"),
    # the same with 4-bit blocks (``Linear.q4``): x, x's row stride, packed nibbles, their fp16 d and m, bias, out,
    # M, K, N, threads
    "linear_q4": ("p", "i", "p", "p", "p", "p", "i", "i", "i", "i"),
    # the same with 8-bit blocks (``Linear.q8``): x, x's row stride, packed int8, their fp16 d, bias, out, M, K, N,
    # threads
    "linear_q8": ("p", "i", "p", "p", "p", "p", "i", "i", "i", "i"),
    # q, q's row stride, k, v, their head stride, start, T, H, KV, D, scale, out, threads; returns 0, or -1 (as
    # ``linear``'s, or out of memory)
    "causal": ("p", "i", "p", "p", "i", "i", "i", "i", "i", "i", "f", "p", "i"),
    # gate and up (rows, 2 I), out (rows, I), rows, I
    "silu_mul": ("p", "p", "i", "i"),
}
# layers_bf16 (bf16 only): layers, n, skip, h, R, E, H, KV, D, I, cos, sin, d, kc, vc, slots_n, slot_stride, L,
# head_stride, slots, pos, scale, work, scratch, per, threads, then a token tree's wpos, kstart, kmap, kmap_w (NULL, 0:
# none; ``TreeMap``); returns 0, or -1 (as ``attention``'s)
LAYERS = ("p", "i", "p", "p", "i", "i", "i", "i", "i", "i", "p", "p", "i", "p", "p", "i", "i", "i", "i", "p", "p", "f",
          "p", "p", "i", "i", "p", "p", "p", "i")
# the kernels that return something (the others: nothing)
RESULTS = {family: ctypes.c_int64 for family in ("attention", "linear", "linear_int8", "linear_q4", "linear_q8",
                                                 "causal")}
CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float}  # p: pointer, i: int64, f: float
SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}  # the dtypes the kernels take
# The families on the linear's tiles, bf16 only (fp32 keeps oneDNN's), and each one's call with nothing to do: it
# returns 0 where the library has the family (the linears: any vector path; ``causal``: avx512_bf16), else -1
PROBES = {"linear": (0,) * 5 + (0, 16, 16, 1), "linear_int8": (0,) * 6 + (0, 16, 16, 1),
          "linear_q4": (0,) * 6 + (0, 32, 16, 1), "linear_q8": (0,) * 6 + (0, 32, 16, 1),
          "causal": (0,) * 7 + (1, 1, 16, 1.0, 0, 1)}
BLOCK_FAMILIES = ("linear_q4", "linear_q8")  # GGUF's blocks: no torch or oneDNN kernel takes them
# /proc/cpuinfo lines that say what -march=native may use (x86 "flags"; ARM "Features" and the part)
PROCESSOR_LINES = ("flags", "Features", "model name", "CPU implementer", "CPU part")


def processor() -> str:
    """What identifies this CPU's instruction set: its /proc/cpuinfo lines that name the model and flags,
    and the level ``$KNNSSD_ISA`` builds for (the native build's key, and the exactness record's)."""
    level = f"|isa={isa()}" if isa() else ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + level
    return "".join(sorted({l for l in lines if l.startswith(PROCESSOR_LINES)})) + level


def isa_flags() -> tuple[str, ...]:
    """The compiler's target: ``-march=native``, or the level ``$KNNSSD_ISA`` names (``x86-64-v3`` for AVX2 with
    FMA, ``x86-64-v4`` for AVX-512 without bf16, ``armv8-a``...), to develop and compare a level's kernels on a
    machine that has more (docs/measuring.md)."""
    return (f"-march={isa() or 'native'}",)


def _remove_stale_builds(folder: Path) -> None:
    """Temporary files left by builds that were killed (a build takes about a second)."""
    for stale in folder.glob(".build-*"):
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 600:
                stale.unlink()


def openmp_flags() -> tuple[str, ...]:
    """``-fopenmp`` where torch runs on GNU OpenMP loaded as ``libgomp.so.1``: the library then names the
    same runtime, so the attention kernel's threads are torch's own pool. Nothing elsewhere (a torch on
    another runtime, or a bundled libgomp under another name: a second pool would fight torch's for the
    cores); the kernel then runs on one thread."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ()
    return ("-fopenmp",) if any(line.endswith("/libgomp.so.1") for line in maps.splitlines()) else ()


def _build(compiler: list[str]) -> Path:
    """The shared library for this source, compiler and processor, compiled unless already there (written
    to a temporary name and renamed, so a killed or concurrent build never leaves a partial library).
    With OpenMP where ``openmp_flags`` allows it and the compiler has it, else without."""
    try:
        return _compile(compiler, FLAGS + isa_flags() + openmp_flags())
    except subprocess.CalledProcessError:
        if not openmp_flags():
            raise
        return _compile(compiler, FLAGS + isa_flags())


def _compile(compiler: list[str], flags: tuple[str, ...]) -> Path:
    key = hashlib.sha256(b"|".join((SOURCE.read_bytes(), " ".join(compiler + list(flags)).encode(),
                                    platform.machine().encode(), processor().encode()))).hexdigest()[:16]
    folder = cache_dir() / "native"
    path = folder / f"knnssd-{key}.so"
    if folder.is_dir():
        _remove_stale_builds(folder)
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([*compiler, *flags, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class Kernels:
    """The loaded library's kernels, per dtype of the tensors they take."""

    rms_norm: dict[torch.dtype, Callable]
    rope: dict[torch.dtype, Callable]
    attention: dict[torch.dtype, Callable]
    linear: dict[torch.dtype, Callable]
    linear_int8: dict[torch.dtype, Callable]
    linear_q4: dict[torch.dtype, Callable]
    linear_q8: dict[torch.dtype, Callable]
    causal: dict[torch.dtype, Callable]
    silu_mul: dict[torch.dtype, Callable]
    layers: Callable  # ``layers_bf16``
    tree_keys: Callable  # ``tree_keys_bf16``: (H, KV, D) -> whether ``layers`` reads a token tree's key map
    attention_scratch: Callable  # (G, D, L) -> the floats of scratch an ``attention`` call needs per thread
    openmp: bool  # built with OpenMP: the kernels share their work among torch's threads
    path: str = "portable"  # the instruction set it was built for (``kernel_path``)


def _load(path: Path) -> Kernels:
    lib = ctypes.CDLL(str(path))
    families = {}
    for family, args in SIGNATURES.items():
        families[family] = {}
        for dtype, suffix in SUFFIXES.items():
            if family in PROBES and dtype != torch.bfloat16:
                continue
            f = getattr(lib, f"{family}_{suffix}")  # AttributeError: a library without it
            f.restype, f.argtypes = RESULTS.get(family), [CTYPES[a] for a in args]
            families[family][dtype] = f
    lib.built_with_openmp.restype = lib.attention_scratch.restype = ctypes.c_int64
    lib.attention_scratch.argtypes = [ctypes.c_int64] * 3
    lib.layers_bf16.restype, lib.layers_bf16.argtypes = ctypes.c_int64, [CTYPES[a] for a in LAYERS]
    lib.tree_keys_bf16.restype, lib.tree_keys_bf16.argtypes = ctypes.c_int64, [ctypes.c_int64] * 3
    lib.kernel_path.restype = ctypes.c_char_p
    return Kernels(**families, layers=lib.layers_bf16, tree_keys=lib.tree_keys_bf16,
                   attention_scratch=lib.attention_scratch,
                   openmp=bool(lib.built_with_openmp()), path=lib.kernel_path().decode())


@functools.cache
def library() -> Kernels | None:
    """The loaded kernels, or None (no compiler, a failed build, or ``KNNSSD_NATIVE=0``), logged once a process."""
    if os.environ.get("KNNSSD_NATIVE", "1") == "0":
        return None
    cc = os.environ.get("CC", "cc")
    compiler = shlex.split(cc)  # e.g. CC="ccache gcc"
    found = shutil.which(compiler[0]) if compiler else None
    if found is None:
        log.info("no C compiler (CC=%s): the step's norms and RoPE run as torch ops", cc)
        return None
    path = None
    try:
        path = _build([found, *compiler[1:]])
        return _load(path)
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the native kernels (%s): the step's norms and RoPE run as torch ops",
                    str(detail)[-300:])
        if path is not None:  # built, but it does not load or lacks a kernel: build it again next time
            path.unlink(missing_ok=True)
        return None


def available() -> bool:
    return library() is not None


def kernel_path() -> str:
    """Which kernels a bf16 step's linears run here, for reports: ``amx`` (tiles), ``avx512_bf16``, ``avx512``,
    ``avx2`` or ``neon`` (``native.c``'s ``kernel_path``) where ``Linear`` is used, else ``torch`` (no library, a
    portable build, or a library without OpenMP beside torch's threads: ``linear_preferred``)."""
    lib = library()
    return lib.path if lib is not None and tiled("linear") is not None else "torch"


@functools.cache
def _has_amx() -> bool:
    return "amx_bf16" in processor()


@functools.cache
def cpu_bf16_dot() -> bool:
    """Whether the CPU has bf16 dot products (avx512_bf16 or AMX): torch's own bf16 kernels use them, and the
    native linears run on ``vdpbf16ps`` or AMX's tiles rather than widened to fp32."""
    return "avx512_bf16" in processor() or _has_amx()


def linear_preferred(lib: Kernels) -> bool:
    """Is ``Linear`` the GEMM to use here? Wherever the library has OpenMP, or torch runs one thread (else the
    kernel would run on one core against oneDNN's threads). AMX CPUs included: there the kernel multiplies on
    AMX's own tiles (``native.c``'s ``amx_columns``), row-invariant by construction and inside the one-call layers,
    where oneDNN's tile GEMM leaves every other op of a step to torch's dispatch and its rows past 16 depend on the
    call's (9 of 64 rows differed from the same rows alone, on a Xeon of model 207). There the kernel's 16 rows
    cost 1.2-1.5x its one row, and a 256-token prefill ran 2.8-5.2x the avx512_bf16 form's (docs/benchmarks.md,
    2026-12-08)."""
    return lib.openmp or torch.get_num_threads() == 1


@functools.cache
def _built(family: str) -> Callable | None:
    lib = library()
    kernel = None if lib is None else getattr(lib, family)[torch.bfloat16]
    return kernel if kernel is not None and kernel(*PROBES[family]) == 0 else None


def tiled(family: str) -> Callable | None:
    """The bf16 kernel of a family on the linear's tiles (``PROBES``) where it is to be used: the library has it
    (``kernel_path``: the linears on any vector instruction set, ``causal`` on avx512_bf16) and
    ``linear_preferred`` holds, or it is a block kernel (``BLOCK_FAMILIES``); else None."""
    lib = library()
    if lib is None:
        return None
    if family in BLOCK_FAMILIES:  # no other kernel runs GGUF's blocks: these run wherever they are built
        return _built(family)
    return _built(family) if linear_preferred(lib) else None
