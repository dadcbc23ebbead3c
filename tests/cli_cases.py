"""Run many `knnssd` command lines that should fail fast in one child process.

Each case runs ``knnssd.cli.main(argv)`` in the same child, one after another, with its own
stderr, and reports its exit code, stderr lines and seconds. The child pays the interpreter's
start and the imports once instead of once per case; anything the child writes to its own
stderr outside a case (an import-time warning, a traceback) fails the run.
"""
import json
import os
import subprocess
import sys
from dataclasses import dataclass

CHILD = r"""
import contextlib, io, json, sys, time
from knnssd.cli import main

results = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    results.append([code, err.getvalue(), time.monotonic() - t0])
print("\n" + json.dumps(results))
"""


@dataclass
class Case:
    code: int
    stderr: list[str]  # stripped, non-empty lines
    seconds: float


def run_cli(cases: list[list[str]], env: dict | None = None, timeout: float = 300, cwd=None) -> list[Case]:
    """``cases``: argument lists (a ``bytes`` argument is passed as the OS would: surrogate-escaped)."""
    argvs = [[os.fsdecode(a) for a in argv] for argv in cases]
    out = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(argvs), env=env, capture_output=True,
                         text=True, timeout=timeout, cwd=cwd)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr[-3000:]
    return [Case(code, [line for line in err.strip().splitlines() if line.strip()], s)
            for code, err, s in json.loads(out.stdout.strip().splitlines()[-1])]
