"""The calibrate deployment from prefect.yaml, run by the session's real `prefect server` and a process worker."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from knnssd import tracking
from servers import PREFECT
from test_integration_calibrate import small_inputs

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


def test_calibrate_deployment_runs_on_a_process_worker(prefect_api, tmp_path, data_dir):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, **prefect_api, "KNNSSD_HOME": str(ROOT), "KNNSSD_WORK": str(tmp_path / "work"),
           "MLFLOW_TRACKING_URI": uri}
    run = lambda *a, **kw: subprocess.run([PREFECT, *a], env=env, cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                          timeout=kw.get("timeout", 120))
    out = run("work-pool", "create", "knnssd-process", "--type", "process", "--overwrite")
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
