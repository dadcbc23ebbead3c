"""Growing banks: the scheduled drop-folder watch (add-domain, then promote) on a real Prefect server
and process worker, two search workers sharing one study, a real `mlflow server`."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from knnssd import tracking
from knnssd.engine.spec.drafters import DrafterConfig
from knnssd.engine.model.skip import SkipMask
from knnssd.routing import bank as banks
from knnssd.search import steps
from knnssd.search.steps import ModelSpec
from conftest import FLOW_DTYPE
from test_integration_calibrate import fixed_bank, small_inputs
from servers import PREFECT, ROOT, KnnssdServer, free_port, wait_http

pytestmark = pytest.mark.integration
SPEC = ModelSpec("smollm2", FLOW_DTYPE)
TINY = {"k_per_domain": 2, "proxy_trials": 2, "real_candidates": 1, "proxy_prompts": 1, "real_prompts": 1,
        "max_new_tokens": 12}


@pytest.fixture(scope="module")
def base_bank(tmp_path_factory, data_dir):
    """A two-domain bank with fixed configurations (no search), as a folder."""
    tmp = tmp_path_factory.mktemp("extend")
    os.environ["KNNSSD_WORK"] = str(tmp / "work")
    configs = {"reasoning": DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(30, attn=[25]).to_dict(), max_len=6,
                                          threshold=0.5, int8=True, adaptive=True),
               "translation": DrafterConfig(kind="ngram", max_len=8, adaptive=True)}
    yield fixed_bank(tmp, data_dir, "bank", lambda c: configs[c.label]), tmp
    os.environ.pop("KNNSSD_WORK", None)


def new_domain_file(data_dir: Path, path: Path, n=9) -> Path:
    """text_to_sql rows without a split field (the file is split 2/3 calib, 1/3 eval)."""
    rows = [json.loads(x) for x in (data_dir / "text_to_sql.jsonl").read_text().splitlines()][:n]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"]}) + "\n" for r in rows))
    return path


def promotions(uri: str) -> list[dict]:
    """What each promote run logged, and where the alias points: the cause when the champion did not move."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("knnssd-promote")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return [{**r.data.params, **r.data.metrics} for r in runs] + [
        {"champion": str(tracking.resolve("models:/knnssd-smollm2@champion", uri).version)}]


def test_watch_deployment_adds_a_dropped_domain_once_then_promotes_it(base_bank, data_dir, prefect_api, prefect_harness,
                                                                       tmp_path):
    """The watch-drop-folder deployment from prefect.yaml, on a process worker: a dropped domain file
    becomes version 2 (add-domain: the base version untouched, the new domain's eval prompts route to
    its new cluster), which promote compares with version 1 and makes the champion; the next run
    (in this process) finds nothing new, and promoting again is refused."""
    bank_dir, tmp = base_bank
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    v1 = steps.register(bank_dir, {"base": True}, uri)
    before = (tracking.download_bank(v1["uri"], tmp_path / "v1-before", uri=uri) / "bank.json").read_text()
    drop = tmp_path / "drop"
    sql = new_domain_file(data_dir, drop / "sql.jsonl")
    env = {**os.environ, **prefect_api, "KNNSSD_HOME": str(ROOT), "KNNSSD_WORK": str(tmp_path / "work"),
           "MLFLOW_TRACKING_URI": uri, "KNNSSD_DROP": str(drop), "KNNSSD_DATA": str(data_dir)}
    run = lambda *a, **kw: subprocess.run([PREFECT, *a], env=env, cwd=ROOT, capture_output=True, text=True,  # noqa: E731
                                          timeout=kw.get("timeout", 120))
    assert run("work-pool", "create", "knnssd-process", "--type", "process", "--overwrite").returncode == 0
    out = run("--no-prompt", "deploy", "-n", "watch-drop-folder-smollm2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    inputs = [str(data_dir / "reasoning.jsonl"), str(data_dir / "translation.jsonl")]
    params = {"params": {"drop": str(drop), "min_prompts": 5, "dtype": FLOW_DTYPE, "use_unmatched": False,
                         "search": {**TINY, "storage": str(tmp_path / "studies.journal")},
                         "promote": {"inputs": inputs, "per_file": 1, "max_new_tokens": 12,
                                     "tolerance": 0.99}}}  # timed beside a server that streams: only a 100x loss refuses
    out = run("deployment", "run", "watch-drop-folder/watch-drop-folder-smollm2", "--params", json.dumps(params))
    assert out.returncode == 0, out.stdout + out.stderr
    # the worker starts beside the server, which is up long before the worker's flow run has imported,
    # loaded, searched and compared the two versions (checked below)
    worker_log = tmp_path / "worker.log"
    with worker_log.open("w") as log:
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "knnssd-process", "--run-once"], env=env,
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        served = _serve_through_the_swap(uri, tmp_path, sql, worker, worker_log)
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    # no request failed, and none went back to version 1 after the swap. The server answered version 1 before its
    # first request (``_serve_through_the_swap``); its first streamed answer may already be version 2's where the
    # worker's promote came first (seen once, its four answers all version 2's).
    versions = [extra["bank_version"] for _, _, extra in served]
    assert versions == sorted(versions) and versions[-1] == "2", versions
    assert all(finish in ("length", "stop") for _, finish, _ in served)
    assert [extra["label"] for is_sql, _, extra in served if is_sql and extra["bank_version"] == "2"][-1] == "sql"

    # add-domain: version 2 was registered as the candidate, with the new domain as a third cluster
    state = json.loads((drop / ".knnssd-processed.json").read_text())
    assert list(state) == ["sql.jsonl"]
    reg = state["sql.jsonl"]["result"]
    assert reg["version"] == "2" and reg["aliases"] == ["candidate"]
    new = banks.load(tracking.download_bank(reg["uri"], tmp_path / "v2", uri=uri))
    assert [c.label for c in new.clusters] == ["reasoning", "translation", "sql"]
    assert new.clusters[2].members == 6 and new.clusters[2].search["proxy_trials"] >= 2
    after = (tracking.download_bank(v1["uri"], tmp_path / "v1-after", uri=uri) / "bank.json").read_text()
    assert before == after  # the base version is untouched
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.serving.routed import RoutedGenerator

    gen = RoutedGenerator(steps.runtime(SPEC)[0], new)
    assert gen.generate(json.loads(sql.read_text().splitlines()[-1])["prompt"], GenerateParams(max_new_tokens=2)).label == "sql"

    # promote: identical outputs on 3 eval prompts (one per base domain and the new one), so v2 is the champion
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    (promotion,) = client.search_runs([client.get_experiment_by_name("knnssd-promote").experiment_id])
    assert promotion.data.metrics["identical"] == 1.0 and promotion.data.params["prompts"] == "3"
    assert promotion.data.params["promote"] == "True"
    assert str(tracking.resolve("models:/knnssd-smollm2@champion", uri).version) == "2"

    # the next scheduled run (here in this process, on the same server) finds nothing new and adds nothing
    from knnssd.flows.promote import PromoteParams, promote
    from knnssd.flows.watch import WatchParams, watch

    again = watch(WatchParams(**params["params"], tracking_uri=uri))
    assert again == {"added": [], "skipped": [], "promotion": None} and len(tracking.versions("smollm2", uri)) == 2
    # trial 4, D7: a file named after a domain the bank holds failed every run after the model load
    twin = new_domain_file(data_dir, drop / "Translation.jsonl")
    again = watch(WatchParams(**params["params"], tracking_uri=uri))
    assert again == {"added": [], "skipped": [str(twin)], "promotion": None}
    assert len(tracking.versions("smollm2", uri)) == 2
    assert promote(PromoteParams(candidate="candidate", inputs=inputs, per_file=1, tracking_uri=uri))["promote"] is False


def _serve_through_the_swap(uri: str, tmp_path: Path, sql: Path, worker: subprocess.Popen, worker_log: Path) -> list:
    """`knnssd serve` on the champion (version 1), streaming requests all through the running ``worker``'s
    add-domain and promote, until it serves version 2: each request's (is the SQL prompt, finish reason,
    ``knnssd`` figures)."""
    server = KnnssdServer(uri, tmp_path, "--dtype", FLOW_DTYPE, "--reload-s", "1")  # passive waits: conftest.py
    if server.info()["knnssd"]["bank_version"] != "1":
        server.stop()
        pytest.fail("the worker promoted version 2 before the server answered: the test's overlap is too tight here")
    served, stop = [], threading.Event()

    def clients():
        sql_prompt = json.loads(sql.read_text().splitlines()[-1])["prompt"]
        while not stop.is_set():
            for p in (sql_prompt, "Translate German to English:\nGuten Morgen."):
                text, finish, extra = "", None, None
                for ch in server.client.completions.create(model="knnssd-smollm2", prompt=p, max_tokens=24,
                                                           temperature=0, stream=True):
                    text += ch.choices[0].text
                    finish, extra = ch.choices[0].finish_reason, ch.choices[0].model_extra.get("knnssd", extra)
                served.append((p == sql_prompt, finish, extra))
                stop.wait(2.0)  # a slow client's pace: the worker's search and promote need the two cores

    pool = ThreadPoolExecutor(1)
    streaming = pool.submit(clients)
    try:
        worker.wait(900)
        out = worker_log.read_text()
        assert worker.returncode == 0, out[-6000:]
        assert len(tracking.versions("smollm2", uri)) == 2, out[-6000:]
        deadline = time.time() + 60  # the server sees the alias move within a second, and swaps between two steps
        while time.time() < deadline and not any(x[2]["bank_version"] == "2" for x in served if x[2]):
            time.sleep(0.5)
        n = len(served)
        while time.time() < deadline and len(served) < n + 2:
            time.sleep(0.2)
        assert server.info()["knnssd"]["bank_version"] == "2", (  # a string: pytest shortens a tuple's repr
            f"{promotions(uri)}\n{server.log_path.read_text()[-4000:]}")
    finally:
        stop.set()
        try:
            streaming.result(timeout=120)  # a request that failed raises here
        finally:
            assert server.stop() == 0
    return served


def test_two_workers_share_one_study_then_one_version(data_dir, prefect_api, prefect_harness, tmp_path):
    import optuna

    from knnssd.flows.calibrate import CalibrateParams, calibrate
    from knnssd.search.study import storage_for

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    journal = tmp_path / "studies.journal"
    inputs = small_inputs(data_dir, tmp_path / "in", domains=("translation",), n=4)
    common = ["--model", "smollm2", "--dtype", FLOW_DTYPE, "--input", inputs[0], "--k-per-domain", "2", "--trials", "4",
              "--candidates", "1", "--proxy-prompts", "1", "--real-prompts", "1", "--max-new-tokens", "12",
              "--storage", str(journal), "--tracking-uri", uri]
    env = {**os.environ, **prefect_api, "KNNSSD_WORK": str(tmp_path / "work")}
    procs = [subprocess.Popen([sys.executable, "-m", "knnssd.cli", "search-worker", *common, "--worker-trials", "2"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out[-3000:]
    storage = storage_for(str(journal))
    (name,) = [n for n in optuna.get_all_study_names(storage) if n.endswith("-proxy")]
    trials = optuna.load_study(study_name=name, storage=storage).trials
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2 + 2  # the sum of both workers
    assert len({t.number for t in trials}) == len(trials)  # no trial number repeats

    os.environ["KNNSSD_WORK"] = str(tmp_path / "work")
    try:
        reg = calibrate(CalibrateParams(model="smollm2", dtype=FLOW_DTYPE, inputs=inputs, k_per_domain=2, proxy_trials=4,
                                        real_candidates=1, proxy_prompts=1, real_prompts=1, max_new_tokens=12,
                                        storage=str(journal), tracking_uri=uri))
    finally:
        os.environ.pop("KNNSSD_WORK", None)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert len([t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]) == 4  # the budget was already met
    assert reg["version"] == "1" and len(tracking.versions("smollm2", uri)) == 1


def test_against_a_real_mlflow_server(base_bank, tmp_path):
    bank_dir, _ = base_bank
    port = free_port()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp_path / "mlflow.log", "w")
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                               str(port), "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                               "--artifacts-destination", str(tmp_path / "artifacts"), "--workers", "1"],
                              env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120, server)
        uri = f"http://127.0.0.1:{port}"
        reg = steps.register(bank_dir, {"server": True}, uri)
        assert reg["aliases"] == ["candidate", "champion"]
        from knnssd.engine.spec.request_params import GenerateParams
        from knnssd.serving.routed import RoutedGenerator

        gen = RoutedGenerator.from_model_uri("models:/knnssd-smollm2@champion", dtype=FLOW_DTYPE, tracking_uri=uri)
        res = gen.generate("Translate German to English: Guten Morgen.", GenerateParams(max_new_tokens=4))
        assert res.tokens and res.label in ("reasoning", "translation")
        run_id = tracking.log_run("knnssd-generation", {"k": 1}, {"m": 1.0}, uri=uri)
        from mlflow import MlflowClient

        assert MlflowClient(uri).get_run(run_id).data.metrics["m"] == 1.0
    finally:
        os.killpg(server.pid, 15)
        server.wait(30)
