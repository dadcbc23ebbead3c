"""Calibration end to end through the Prefect flow on SmolLM2, with a real MLflow (sqlite)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from knnssd import tracking
from knnssd.routing import bank as banks
from knnssd.search import calibration

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


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
    from knnssd.search.calibration import ModelSpec

    spec = ModelSpec("smollm2", "float32")
    rows = calibration.load_prompts(small_inputs(data_dir, tmp / "in", n=n))
    vectors = calibration.embed(spec, rows)
    clusters = (calibration.make_clusters(vectors, k_per_domain=2) if labelled
                else calibration.make_clusters(vectors, n_clusters=1, labelled=False))
    results = [banks.ClusterResult(c.id, cfg_of(c).to_dict(), speedup=1.2, acceptance_rate=0.6, mean_accepted=2.0)
               for c in clusters]
    return calibration.build_bank(spec, clusters, results, vectors, calibration.router.Pooling(), tmp / name)


@pytest.fixture()
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("KNNSSD_WORK", str(tmp_path / "work"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return tmp_path, uri


def test_calibrate_flow_end_to_end(isolated, data_dir, prefect_harness):
    from knnssd.flows.calibrate import CalibrateParams, calibrate

    tmp, uri = isolated
    t0 = time.time()
    params = CalibrateParams(model="smollm2", dtype="float32", inputs=small_inputs(data_dir, tmp / "in"), k_per_domain=3,
                             proxy_trials=4, real_candidates=1, proxy_prompts=2, real_prompts=1, max_new_tokens=24,
                             storage=str(tmp / "studies.journal"), tracking_uri=uri)
    reg = calibrate(params)
    assert time.time() - t0 < 300
    assert reg["name"] == "knnssd-smollm2" and set(reg["aliases"]) == {"candidate", "champion"}
    folder = tracking.download_bank("models:/knnssd-smollm2@champion", tmp / "dl", uri)
    bank = banks.load(folder)  # validates
    assert {c.label for c in bank.clusters} == {"reasoning", "translation"}
    assert len(bank.anchors) == 6 and bank.model == "smollm2" and bank.n_layers == 30
    assert all(c.speedup >= 1.0 for c in bank.clusters)  # plain AR is always a candidate
    assert {"skip_heatmap.png", "anchor_map.png"} <= {p.name for p in folder.iterdir()}
    # a second calibration adds a version: candidate moves, champion stays
    reg2 = calibrate(params)
    assert reg2["version"] != reg["version"] and reg2["aliases"] == ["candidate"]
    assert str(tracking.resolve("models:/knnssd-smollm2@champion", uri).version) == reg["version"]


def _journal_trials(storage: str) -> int:
    import optuna

    from knnssd.search.study import storage_for

    st = storage_for(storage)
    return sum(len([t for t in s.trials if t.state.is_finished()]) for s in
               (optuna.load_study(study_name=x.study_name, storage=st) for x in optuna.get_all_study_summaries(st)))


def test_sigkill_mid_search_then_rerun_resumes(isolated, data_dir, prefect_api):
    tmp, uri = isolated
    storage = str(tmp / "studies.journal")
    args = [sys.executable, "-m", "knnssd.cli", "calibrate", "--dtype", "float32", "--k-per-domain", "2",
            "--trials", "12", "--candidates", "1", "--proxy-prompts", "2", "--real-prompts", "1",
            "--max-new-tokens", "16", "--storage", storage, "--tracking-uri", uri]
    for p in small_inputs(data_dir, tmp / "in", n=6):
        args += ["--input", p]
    env = {**os.environ, **prefect_api}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 400
    before = 0
    while time.time() < deadline and proc.poll() is None:
        time.sleep(2)
        if Path(storage).exists():
            before = _journal_trials(storage)
            if before >= 3:
                break
    assert proc.poll() is None, "calibration ended before it could be killed: " + proc.stdout.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert tracking.versions("smollm2", uri) == []  # nothing registered by the killed run
    before = _journal_trials(storage)

    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _journal_trials(storage) >= before + 1
    assert len(tracking.versions("smollm2", uri)) == 1
