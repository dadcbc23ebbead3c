"""The native kernels on every instruction set, whatever the machine: ``tests/native_check.c`` (row-invariance of the
linears, the attention, token trees and whole layers, checked in C) built for each level this CPU runs, and for
ARM64 under qemu-user where ``make cross`` installed the cross compiler and qemu (Debian's packages).

The wide paths (AVX2, AVX-512F, NEON) define the same arithmetic for the linears, column by column, so the digest
of their outputs must agree across instruction sets: an ARM64 build run under emulation checks the x86 build's
bits, and the reverse. avx512_bf16's tiles round otherwise (``vdpbf16ps``) and are only checked for invariance."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ENGINE = HERE.parent / "knnssd" / "engine"
FLAGS = ["-O2", "-ffp-contract=off", "-fopenmp", f"-I{ENGINE}"]
# x86 levels: the -march a build names, and the /proc/cpuinfo flags a CPU needs to run it
X86 = {"x86-64-v3": ("avx2", "fma", "f16c"), "x86-64-v4": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
       "x86-64-v4+bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")}
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


@pytest.fixture(scope="module")
def wide_digest(tmp_path_factory) -> str | None:
    """The linears' digest of the AVX2 build, where this CPU runs it (the reference the other wide paths match)."""
    if shutil.which("cc") is None or not set(X86["x86-64-v3"]) <= _flags():
        return None
    return _run([str(_build(tmp_path_factory.mktemp("v3"), "cc", "x86-64-v3"))])["linears"]


@pytest.mark.parametrize("level", sorted(X86))
def test_each_x86_level_this_cpu_runs_keeps_rows_alone(level, tmp_path, wide_digest):
    if shutil.which("cc") is None or os.uname().machine != "x86_64":
        pytest.skip("needs an x86-64 machine with a C compiler")
    if not set(X86[level]) <= _flags():
        pytest.skip(f"this CPU cannot run {level} (it lacks {sorted(set(X86[level]) - _flags())})")
    got = _run([str(_build(tmp_path, "cc", level))])
    assert got["path"] == {"x86-64-v3": "avx2", "x86-64-v4": "avx512", "x86-64-v4+bf16": "avx512_bf16"}[level]
    if got["path"] != "avx512_bf16" and wide_digest is not None:
        assert got["linears"] == wide_digest  # the same arithmetic as AVX2's, column by column


@pytest.mark.parametrize("march", sorted(ARM))
def test_arm64_under_qemu_keeps_rows_alone_and_computes_avx2s_bits(march, tmp_path, wide_digest):
    if os.uname().machine == "aarch64":  # an ARM64 machine runs it itself
        cross, qemu = shutil.which("cc"), ()
    else:
        cross, qemu = shutil.which("aarch64-linux-gnu-gcc"), (shutil.which("qemu-aarch64"),)
    if cross is None or None in qemu:
        pytest.skip("no ARM64 cross compiler or qemu-aarch64 here (make cross installs them)")
    got = _run([*qemu, str(_build(tmp_path, cross, march, ("-static",) if qemu else ()))])
    assert got["path"] == ARM[march]
    if wide_digest is not None:
        assert got["linears"] == wide_digest
