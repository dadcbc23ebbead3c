"""Run many `knnssd` command lines that should fail fast, in one child process per call.

Each call's cases run as ``knnssd.cli.main(argv)`` in one child, one after another, each with its own
stderr, and report their exit code, stderr lines and seconds (a ``Stopwatch``'s: less the time spent
waiting for a CPU). Anything the child, or the helper it is forked from, writes to its own stderr
outside a case (an import-time warning, a traceback), or a child that does not exit 0, fails the call.

The children are forked from one helper process per session that has already imported what every
command imports (torch, transformers, MLflow, pandas): a call then pays neither the interpreter's start
nor those imports, nor the teardown of their modules at exit (docs/benchmarks.md, 2026-11-27). A child
takes the call's environment and folder before it runs anything. Prefect is not imported beforehand:
it reads its settings from the environment when it is imported, and each call has an environment of
its own.
"""
import atexit
import contextlib
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass


def run_queue_delay() -> float:
    """Seconds the calling thread has been ready to run but waiting for a CPU, from Linux's schedstat;
    0.0 where the kernel does not report it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Stopwatch:
    """Seconds since it started, less the time the calling thread waited for a CPU. A test's bound on
    how soon something answers uses it: `make test` runs two workers on two cores (tests/conftest.py),
    and a test's work waits for whatever CPU the other worker leaves."""

    def __init__(self):
        self.t0, self.d0 = time.monotonic(), run_queue_delay()

    def seconds(self) -> float:
        return max(0.0, time.monotonic() - self.t0 - (run_queue_delay() - self.d0))


HELPER = r"""
import atexit, contextlib, gc, io, json, os, sys, tempfile, threading, time, traceback
from knnssd.cli import ENV_DEFAULTS, main  # before the libraries, as in a process of its own: it sets ENV_DEFAULTS
import numpy, pandas, pyarrow.parquet, torch, transformers, mlflow  # noqa: F401 - imported once, for every child

gc.freeze()  # the imports' objects stay out of the children's collections, and their pages shared
# settings these libraries read once, when they load: a call must not ask for others
LOADED = ("OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_", "OPENBLAS_", "ATEN_", "HF_", "HUGGINGFACE_")
# but these two the test process gains when it imports scikit-learn, joblib or threadpoolctl (a setdefault
# for Intel's OpenMP, which torch's wheel does not use), whichever test imports them first
BY_IMPORTS = ("KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK")


def load_time(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(LOADED) and k not in BY_IMPORTS}


AT_LOAD = load_time(os.environ)


def cases(req):
    os.environ.clear()
    os.environ.update(req["env"])
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    asked = load_time(os.environ)
    if asked != AT_LOAD:
        raise RuntimeError(f"the call's load-time settings {asked} are not the helper's {AT_LOAD}")
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    os.chdir(req["cwd"])
    results = []
    for argv in req["argvs"]:
        err = io.StringIO()
        watch = Stopwatch()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code
        results.append([code, err.getvalue(), watch.seconds()])
    return results


def child(req, w):  # a process's life and exit, less the teardown of the modules the helper still holds
    try:
        with os.fdopen(w, "w") as out:
            out.write(json.dumps(cases(req)))
        threading._shutdown()  # as an exit does: wait for the threads a case left running
        gc.collect()
        atexit._run_exitfuncs()
        code = 0
    except BaseException:  # noqa: BLE001 - reported, as an uncaught exception would be
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)


for line in sys.stdin:
    req = json.loads(line)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: stdin and stdout are the helper's; its stderr goes to the call's file
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(os.open(req["stray"], os.O_WRONLY | os.O_APPEND), 2)
        child(req, w)
    os.close(w)
    print(json.dumps({"pid": pid}), flush=True)
    with os.fdopen(r) as inp:
        results = inp.read()
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status), "results": results}), flush=True)
"""

_STOPWATCH = "import os, time\n" + inspect.getsource(run_queue_delay) + inspect.getsource(Stopwatch)
_helper: subprocess.Popen | None = None
_pending = b""  # what the helper wrote past the last line read


@dataclass
class Case:
    code: int
    stderr: list[str]  # stripped, non-empty lines
    seconds: float


def _start() -> subprocess.Popen:
    global _helper, _pending
    if _helper is None or _helper.poll() is not None:
        _stop()  # a helper that ended: its log goes
        with tempfile.NamedTemporaryFile("w", prefix="cli-helper-", suffix=".log", delete=False) as log:
            _helper = subprocess.Popen([sys.executable, "-c", _STOPWATCH + HELPER], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=log, bufsize=0)
        _helper.log_path, _pending = log.name, b""
    return _helper


def _line(helper: subprocess.Popen, deadline: float) -> dict:
    """The helper's next line, read from its pipe as it comes (a buffered reader could hold a line that
    ``select`` would then never report)."""
    global _pending
    while b"\n" not in _pending:
        if not select.select([helper.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError
        chunk = os.read(helper.stdout.fileno(), 65536)
        if not chunk:
            raise AssertionError("the CLI helper process ended: " + open(helper.log_path).read()[-3000:])
        _pending += chunk
    line, _pending = _pending.split(b"\n", 1)
    return json.loads(line)


def _stop() -> None:
    if _helper is None:
        return
    if _helper.poll() is None:
        _helper.stdin.close()
        try:
            _helper.wait(30)
        except subprocess.TimeoutExpired:
            _helper.kill()
            _helper.wait()
    if os.path.exists(_helper.log_path):
        os.unlink(_helper.log_path)


atexit.register(_stop)


def _reset(pid: int | None) -> None:
    """Stop the call's child, if any, and the helper: a helper left with a call's replies unread would
    answer the next call with them."""
    global _helper
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if _helper is not None and _helper.poll() is None:
        _helper.kill()
        _helper.wait()
    _stop()
    _helper = None


def run_cli(cases: list[list[str]], env: dict | None = None, timeout: float = 300, cwd=None) -> list[Case]:
    """``cases``: argument lists (a ``bytes`` argument is passed as the OS would: surrogate-escaped)."""
    helper = _start()
    stray = pid = None
    try:
        with tempfile.NamedTemporaryFile(prefix="cli-stray-", suffix=".txt", delete=False) as f:
            stray = f.name
        req = {"argvs": [[os.fsdecode(a) for a in argv] for argv in cases],
               "env": dict(os.environ if env is None else env), "cwd": os.fspath(cwd or os.getcwd()), "stray": stray}
        data = memoryview(json.dumps(req).encode() + b"\n")
        while data:  # an unbuffered pipe may take part of it
            data = data[os.write(helper.stdin.fileno(), data):]
        deadline = time.monotonic() + timeout
        pid = _line(helper, deadline)["pid"]
        done = _line(helper, deadline)
        with open(stray, errors="replace") as f, open(helper.log_path, errors="replace") as g:
            err = g.read() + f.read()  # the helper's own imports' warnings count as the child's
    except TimeoutError:
        _reset(pid)
        raise subprocess.TimeoutExpired(["knnssd", *cases[0]], timeout) from None
    except BaseException:
        _reset(pid)
        raise
    finally:
        if stray is not None:
            os.unlink(stray)
    if done["status"] != 0 or err.strip():
        _reset(None)  # the next call starts from a helper whose log is empty
        raise AssertionError((done["status"], err[-3000:]))
    return [Case(code, [line for line in e.strip().splitlines() if line.strip()], s)
            for code, e, s in json.loads(done["results"])]


def hold_output(output, seconds=60) -> subprocess.Popen:
    """A child process that holds ``output``'s writer lock (``output_paths.writing``), as a running `generate`
    does, for ``seconds``; it holds the lock once this returns."""
    code = textwrap.dedent(f"""
        import sys, time
        from knnssd.serving import output_paths
        with output_paths.writing({str(output)!r}):
            print("held", flush=True)
            time.sleep({seconds})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc
