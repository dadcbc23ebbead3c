"""The calibrate deployment from prefect.yaml, run by a real `prefect server` and a process worker."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from knnssd import tracking
from test_integration_calibrate import small_inputs

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


@pytest.fixture()
def prefect_server(tmp_path):
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/api/health", 120, server)
        yield {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)


def test_calibrate_deployment_runs_on_a_process_worker(prefect_server, tmp_path, data_dir):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**prefect_server, "KNNSSD_HOME": str(ROOT), "KNNSSD_WORK": str(tmp_path / "work"),
           "MLFLOW_TRACKING_URI": uri}
    run = lambda *a, **kw: subprocess.run([PREFECT, *a], env=env, cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                          timeout=kw.get("timeout", 120))
    out = run("work-pool", "create", "knnssd-process", "--type", "process")
    assert out.returncode == 0, out.stdout + out.stderr
    out = run("--no-prompt", "deploy", "-n", "calibrate-smollm2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    params = {"params": {"model": "smollm2", "dtype": "float32", "inputs": small_inputs(data_dir, tmp_path / "in", n=6),
                         "k_per_domain": 2, "proxy_trials": 2, "real_candidates": 1, "proxy_prompts": 1,
                         "real_prompts": 1, "max_new_tokens": 12, "storage": str(tmp_path / "studies.journal")}}
    out = run("deployment", "run", "calibrate/calibrate-smollm2", "--params", json.dumps(params))
    assert out.returncode == 0, out.stdout + out.stderr
    out = run("worker", "start", "--pool", "knnssd-process", "--run-once", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    versions = tracking.versions("smollm2", uri)
    assert len(versions) == 1, out.stdout[-3000:] + out.stderr[-3000:]
