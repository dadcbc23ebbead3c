"""Commands stopped by a signal: one inside a Prefect flow removes its lock and exits 143, and
``knnssd ui`` stops MLflow's whole process group and leaves nothing behind."""
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from knnssd.serving import output_paths

pytestmark = pytest.mark.integration


def test_sigterm_mid_flow_unwinds_the_command_and_removes_its_lock(tmp_path, prefect_api):
    """SIGTERM to a command inside a flow (as ``knnssd generate`` holds ``<output>.lock`` around its
    flow): Prefect's handler marks the run Crashed and sends the signal on to the CLI's
    (``cli._signals_unwind``), which raises ``Terminated``: the lock file is removed on the way out and
    the exit status is 143, as ``main`` returns. (SIGTERM's default action ended the process there and
    left the file.)"""
    out = tmp_path / "out.parquet"
    code = textwrap.dedent(f"""
        import sys, time
        from prefect import flow, task
        from knnssd.cli import Terminated, _signals_unwind
        from knnssd.serving import output_paths

        @task
        def nap():
            print("napping", flush=True)
            time.sleep(60)

        @flow
        def run():
            nap()

        with _signals_unwind():
            try:
                with output_paths.writing({str(out)!r}):
                    run()
            except Terminated as e:
                sys.exit(128 + e.signum)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **prefect_api}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        while proc.stdout.readline().strip() != "napping":
            assert proc.poll() is None, "the flow ended before its task ran"
        assert output_paths.lock_path(out).exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert not output_paths.lock_path(out).exists()
    finally:
        proc.kill()
        proc.wait()


def test_ui_stopped_by_sigterm_leaves_no_process(tmp_path):
    """``knnssd ui`` runs ``mlflow ui`` (a server and its worker) in a process group of its own; SIGTERM to
    knnssd stops the whole group (a SIGKILLed or orphaned ``mlflow ui`` left them running), and nothing is
    left in /dev/shm (MLflow's job runner, which knnssd turns off, left a folder there each start)."""
    import urllib.request

    from knnssd.processes import group_members
    from servers import free_port

    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    err = tmp_path / "ui.log"  # a file: processes that outlive knnssd would hold a pipe open
    shm = Path("/dev/shm")
    folders = lambda: {p for p in shm.iterdir() if p.is_dir()} if shm.is_dir() else set()  # noqa: E731
    before = folders()
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "knnssd.cli", "ui", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=fh)
    child = None
    try:
        deadline, up = time.time() + 120, False
        while time.time() < deadline and not up and proc.poll() is None:
            try:
                up = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                time.sleep(0.5)
        assert up, err.read_text()[-2000:]
        child = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])
        assert child in group_members(child)  # the UI's own group (start_new_session: its pgid is its pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
        assert err.read_text().strip().splitlines()[-1] == "knnssd: terminated (SIGTERM)"
        deadline = time.time() + 15
        while time.time() < deadline and group_members(child):
            time.sleep(0.2)
        assert not group_members(child), "processes of the UI's group outlived knnssd"
        assert not folders() - before, f"left in /dev/shm: {sorted(map(str, folders() - before))}"
    finally:
        proc.kill()
        proc.wait()
        if child is not None:
            with contextlib.suppress(OSError):
                os.killpg(child, signal.SIGKILL)
