"""The native kernels on every instruction set, whatever the machine: ``tests/native_check.c`` (row-invariance of the
linears, the attention, token trees and whole layers, checked in C) built for each level this CPU runs, and for
ARM64 under qemu-user where ``make cross`` installed the cross compiler and qemu (Debian's packages).

The wide paths (AVX2, AVX-512F, NEON) define the same arithmetic for the linears, column by column, so the digest
of their outputs must agree across instruction sets: an ARM64 build run under emulation checks the x86 build's
bits, and the reverse. avx512_bf16's tiles round otherwise (``vdpbf16ps``): its builds are checked for invariance, and
against each other. The 4-bit and 8-bit blocks are summed in integers on every path, avx512_bf16's included, so
their digest is the same everywhere. AMX CPUs (Sapphire Rapids and later) run the bf16 linears on tiles (``tdpbf16ps``,
``native.c``'s ``amx_columns``) and the blocks' sums on int8 tiles where this CPU has AMX: the tiles add each product
in order into an fp32 sum, the wide paths' arithmetic, so that build must match the AVX2 build's digests; elsewhere,
less the extensions this CPU lacks (AVX512-FP16, AVX-VNNI, AMX), it is avx512_bf16's form and must match that build."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ENGINE = HERE.parent / "knnssd" / "engine" / "model"
FLAGS = ["-O2", "-ffp-contract=off", "-fopenmp", f"-I{ENGINE}"]
# x86 levels: the -march a build names, and the /proc/cpuinfo flags a CPU needs to run it
X86 = {"x86-64-v3": ("avx2", "fma", "f16c"), "x86-64-v4": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
       "x86-64-v4+bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
       "sapphirerapids": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")}
# Sapphire Rapids' vector extensions that a compiler may use unasked (/proc/cpuinfo flag -> the option that drops it),
# and AMX's, which it never uses unasked: dropped where this CPU lacks them, so that the build runs here
SPR_EXTRAS = {"avx512_fp16": "-mno-avx512fp16", "avx_vnni": "-mno-avxvnni", "amx_tile": "-mno-amx-tile",
              "amx_bf16": "-mno-amx-bf16", "amx_int8": "-mno-amx-int8"}
PATHS = {"x86-64-v3": "avx2", "x86-64-v4": "avx512", "x86-64-v4+bf16": "avx512_bf16", "sapphirerapids": "avx512_bf16"}
AMX = ("amx_tile", "amx_bf16")  # where this CPU has them, the sapphirerapids build runs the linears on tiles
ARM = {"armv8-a": "neon", "armv8.2-a+dotprod": "neon"}  # -march -> the kernel path it builds


def _flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith(("flags", "Features")) for f in line.split(":", 1)[1].split()}


def _build(tmp: Path, compiler: str, march: str, extra: tuple[str, ...] = ()) -> Path:
    out = tmp / f"check-{march.replace('+', '-')}"
    flags = [f"-march={march.removesuffix('+bf16')}", *(["-mavx512bf16"] if march.endswith("+bf16") else [])]
    subprocess.run([compiler, *FLAGS, *flags, *extra, "-o", str(out), str(HERE / "native_check.c"), "-lm"], check=True,
                   capture_output=True, text=True, timeout=300)
    return out


def _run(cmd: list[str]) -> dict[str, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)


def _level_flags(level: str) -> tuple[str, ...]:
    if level != "sapphirerapids":
        return ()
    return tuple(option for flag, option in SPR_EXTRAS.items() if flag not in _flags())


def _digests(tmp_path_factory, level: str) -> dict[str, str] | None:
    """What a level's build prints (its path and digests), where this CPU runs it."""
    if shutil.which("cc") is None or os.uname().machine != "x86_64" or not set(X86[level]) <= _flags():
        return None
    folder = tmp_path_factory.mktemp(level.replace("+", "-"))
    return _run([str(_build(folder, "cc", level, _level_flags(level)))])


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, str] | None:
    """The AVX2 build's digests, where this CPU runs it: the reference the other wide paths match, and every path's
    blocks."""
    return _digests(tmp_path_factory, "x86-64-v3")


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> dict[str, str] | None:
    """The avx512_bf16 build's digests, where this CPU runs it (what AMX's build must match)."""
    return _digests(tmp_path_factory, "x86-64-v4+bf16")


def _agrees(got: dict[str, str], wide: dict | None, bf16: dict | None) -> None:
    reference = bf16 if got["path"] == "avx512_bf16" else wide
    if reference is not None:  # the same arithmetic as AVX2's (or avx512_bf16's), column by column
        assert got["linears"] == reference["linears"]
    if wide is not None:  # the blocks' integer sums: the same bits on every path
        assert got["blocks"] == wide["blocks"]


@pytest.mark.parametrize("level", sorted(X86))
def test_each_x86_level_this_cpu_runs_keeps_rows_alone(level, tmp_path, wide, bf16):
    if shutil.which("cc") is None or os.uname().machine != "x86_64":
        pytest.skip("needs an x86-64 machine with a C compiler")
    if not set(X86[level]) <= _flags():
        pytest.skip(f"this CPU cannot run {level} (it lacks {sorted(set(X86[level]) - _flags())})")
    got = _run([str(_build(tmp_path, "cc", level, _level_flags(level)))])
    assert got["path"] == ("amx" if level == "sapphirerapids" and set(AMX) <= _flags() else PATHS[level])
    _agrees(got, wide, bf16)


@pytest.mark.parametrize("march", sorted(ARM))
def test_arm64_under_qemu_keeps_rows_alone_and_computes_avx2s_bits(march, tmp_path, wide):
    if os.uname().machine == "aarch64":  # an ARM64 machine runs it itself
        cross, qemu = shutil.which("cc"), ()
    else:
        cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), (shutil.which("qemu-aarch64"),)
    if cross is None or None in qemu:
        pytest.skip("no ARM64 cross compiler or qemu-aarch64 here (make cross installs them)")
    got = _run([*qemu, str(_build(tmp_path, cross, march, ("-static",) if qemu else ()))])
    assert got["path"] == ARM[march]
    _agrees(got, wide, None)
