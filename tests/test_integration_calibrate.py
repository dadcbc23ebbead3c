"""Calibration end to end on SmolLM2 (the CLI, stopped mid-search, then resumed by its Prefect deployment on
a process worker), with a real MLflow (sqlite); and fixed banks for the other integration tests."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import FLOW_DTYPE

from knnssd import tracking
from knnssd.routing import bank as banks
from knnssd.search import budget, steps
from servers import PREFECT, ROOT

pytestmark = pytest.mark.integration


def small_inputs(data_dir: Path, out: Path, domains=("reasoning", "translation"), n=10) -> list[str]:
    """The first n calib rows of each domain (files written to a temp folder, never into the repo)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in domains:
        rows = [json.loads(x) for x in (data_dir / f"{d}.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["split"] == "calib"][:n]
        p = out / f"{d}.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(p))
    return paths


def fixed_bank(tmp: Path, data_dir: Path, name: str, cfg_of, labelled: bool = True, n: int = 6) -> Path:
    """A bank of the first n calib prompts of reasoning + translation with fixed configurations (no
    search): ``cfg_of(cluster) -> DrafterConfig``; one cluster per domain, or one for all."""
    from knnssd.search.steps import ModelSpec

    spec = ModelSpec("smollm2", FLOW_DTYPE)
    rows = steps.load_prompts(small_inputs(data_dir, tmp / "in", n=n))
    vectors = steps.embed(spec, rows)
    clusters = (steps.make_clusters(vectors, k_per_domain=2) if labelled
                else steps.make_clusters(vectors, n_clusters=1, labelled=False))
    results = [banks.ClusterResult(c.id, cfg_of(c).to_dict(), speedup=1.2, acceptance_rate=0.6, mean_accepted=2.0)
               for c in clusters]
    return steps.build_bank(spec, clusters, results, vectors, steps.router.Pooling(), tmp / name)


@pytest.fixture()
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("KNNSSD_WORK", str(tmp_path / "work"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return tmp_path, uri


def _journal_trials(storage: str) -> int:
    import optuna

    from knnssd.search.study import storage_for

    st = storage_for(storage)
    return sum(len([t for t in s.trials if t.state.is_finished()]) for s in
               (optuna.load_study(study_name=x.study_name, storage=st) for x in optuna.get_all_study_summaries(st)))


STOP_S = 30  # from SIGTERM to exit; before searches stopped on it, the queued searches ran to their end first


def test_calibration_stopped_mid_search_is_resumed_by_its_deployment(isolated, data_dir, prefect_api):
    """One calibration two ways, in turn, on the session's Prefect server and one MLflow (sqlite):
    1. ``knnssd calibrate`` sent SIGTERM mid-search stops within ``STOP_S`` (its searches, the one running
       and those queued on the machine lock, stop after the trial in progress) and registers nothing;
    2. the calibrate deployment from prefect.yaml, on a process worker, with the same settings and
       studies, resumes them and registers version 1 (candidate and champion). (A later version of a
       model becomes the candidate only: add-domain's, in test_integration_extend.)"""
    tmp, uri = isolated
    storage = str(tmp / "studies.journal")
    inputs = small_inputs(data_dir, tmp / "in", n=6)
    settings = {"k_per_domain": 2, "proxy_trials": 8, "real_candidates": 1, "proxy_prompts": 2, "real_prompts": 1,
                "max_new_tokens": 16}
    args = [sys.executable, "-m", "knnssd.cli", "calibrate", "--dtype", FLOW_DTYPE, "--k-per-domain",
            str(settings["k_per_domain"]), "--storage", storage, "--tracking-uri", uri]
    for s in budget.settings():  # the same search settings as CLI flags
        if s.name in settings:
            args += [s.flag, str(settings[s.name])]
    for p in inputs:
        args += ["--input", p]
    env = {**os.environ, **prefect_api}
    deployed = {**env, "KNNSSD_HOME": str(ROOT), "MLFLOW_TRACKING_URI": uri}
    run = lambda *a, **kw: subprocess.run([PREFECT, *a], env=deployed, cwd=ROOT, capture_output=True,  # noqa: E731
                                          text=True, timeout=kw.get("timeout", 120))
    params = {"params": {"model": "smollm2", "dtype": FLOW_DTYPE, "inputs": inputs, "storage": storage, **settings}}

    def schedule() -> list:  # the deployment and its run, while the CLI searches: no worker takes the run yet
        return [run("work-pool", "create", "knnssd-process", "--type", "process", "--overwrite"),
                run("--no-prompt", "deploy", "-n", "calibrate-smollm2"),
                run("deployment", "run", "calibrate/calibrate-smollm2", "--params", json.dumps(params))]

    scheduling = ThreadPoolExecutor(1)
    scheduled = scheduling.submit(schedule)
    scheduling.shutdown(wait=False)
    taken = False
    try:
        before = _stopped_mid_search(args, env, tmp / "calibrate.log", storage, uri)
        for out in scheduled.result(timeout=400):
            assert out.returncode == 0, out.args[1:3] + [out.stdout[-3000:] + out.stderr[-3000:]]
        out = run("worker", "start", "--pool", "knnssd-process", "--run-once", timeout=900)
        taken = True
    finally:
        if not taken:  # a run left scheduled in the session's pool would be taken by another test's worker
            with contextlib.suppress(Exception):  # the test's own failure is the one to report
                flow_run = re.search(r"UUID: ([0-9a-f-]{36})", scheduled.result(timeout=400)[-1].stdout)
                run("flow-run", "delete", flow_run[1])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert _journal_trials(storage) >= before + 1  # resumed: the studies' trials so far, and more
    assert len(tracking.versions("smollm2", uri)) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    for alias in ("candidate", "champion"):
        assert str(tracking.resolve(f"models:/knnssd-smollm2@{alias}", uri).version) == "1"
    folder = tracking.download_bank("models:/knnssd-smollm2@champion", tmp / "dl", uri)
    bank = banks.load(folder)  # validates
    assert {c.label for c in bank.clusters} == {"reasoning", "translation"}
    assert len(bank.anchors) == 4 and bank.model == "smollm2" and bank.n_layers == 30
    assert all(c.speedup >= 1.0 for c in bank.clusters)  # plain AR is always a candidate
    assert {"skip_heatmap.png", "anchor_map.png"} <= {p.name for p in folder.iterdir()}


def _stopped_mid_search(args: list[str], env: dict, log: Path, storage: str, uri: str) -> int:
    """``knnssd calibrate`` (``args``) sent SIGTERM once its studies hold 3 trials: it must stop within
    ``STOP_S``, unwound, with nothing registered. The trials its studies then hold."""
    with log.open("w") as out:  # a file, not a pipe nobody reads: a full pipe would block the run's shutdown
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 400
    before = 0
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
        if Path(storage).exists():
            before = _journal_trials(storage)
            if before >= 3:
                break
    assert proc.poll() is None, "calibration ended before it could be stopped: " + log.read_text()[-2000:]
    os.kill(proc.pid, signal.SIGTERM)  # as `kill PID`, a scheduler or a Prefect worker's cancellation would
    try:
        proc.wait(STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"calibrate still ran {STOP_S} s after SIGTERM: its searches did not stop")
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-2000:]  # unwound (cli.Terminated), not killed
    assert "knnssd: terminated (SIGTERM)" in log.read_text().splitlines(), log.read_text()[-2000:]
    assert tracking.versions("smollm2", uri) == []  # nothing registered by the stopped run
    return _journal_trials(storage)


def test_a_workers_clusters_take_the_model_in_turn(smollm2, data_dir, tmp_path):
    """Trial 5, D2: search-worker runs its clusters' stage-1 trials as Prefect tasks on threads, over the
    process's one decoder; two at once wrote each other's KV cache (CacheFull after 38 s). A worker now
    waits for the model (``LoadedModel.busy``) that another holds."""
    import threading

    import numpy as np

    from knnssd.routing import router

    spec = steps.ModelSpec("smollm2", FLOW_DTYPE)
    lm, _ = steps.runtime(spec)
    texts = [r.prompt for r in steps.load_prompts(small_inputs(data_dir, tmp_path / "in", ("translation",), n=2))]
    cluster = router.Cluster(0, "translation", np.zeros((1, 4), np.float32), ["a"], {"translation": 1})
    tiny_budget = budget.Budget(proxy_trials=1, real_candidates=1, proxy_prompts=1, real_prompts=1, max_new_tokens=8)
    out: list[dict] = []
    worker = threading.Thread(target=lambda: out.append(steps.proxy_worker(
        spec, cluster, texts, tiny_budget, str(tmp_path / "j.log"), "turns", 1)))
    with lm.busy:  # another cluster's task holds the model
        worker.start()
        time.sleep(1.5)
        assert worker.is_alive() and not out
    worker.join(300)
    assert out and out[0]["added"] == 1
