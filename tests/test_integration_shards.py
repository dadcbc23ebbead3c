"""A sharded `knnssd generate` on real parts: the session's Prefect server, a `process` work pool, two
workers started here, and a real MLflow; one worker killed mid-shard, and the alias moved mid-run."""
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from knnssd import prompts, tracking
from knnssd.engine.spec.drafters import DrafterConfig
from knnssd.search import steps
from knnssd.serving import resume, shards
from cli_cases import run_cli
from servers import PREFECT
from test_integration_calibrate import fixed_bank
from test_integration_generate import cli_env, descendants, generate_argv, registered  # noqa: F401

pytestmark = pytest.mark.integration


# The module's cut: shards of a few dozen short rows, one at a time (``--batch-size 1``: a shard's run
# then starts its rows at once, where auto batching first plans for seconds in every run). What it tests
# is the cut, the kills and the joins; batched rows are the generate module's. Summarization's articles
# are left out: their prefills were most of the module's work (docs/benchmarks.md, 2026-12-07, evening).
ROWS, SHARDS, TOKENS = 48, 3, 8
SHORT_DOMAINS = ("reasoning", "storytelling", "text_to_sql", "translation")


def eval_prompts(data_dir: Path, out: Path, n: int) -> Path:
    """``n`` eval prompts, taken in turn from each domain of ``SHORT_DOMAINS``."""
    by_domain = [[json.loads(x) for x in (data_dir / f"{d}.jsonl").read_text().splitlines() if '"eval"' in x]
                 for d in SHORT_DOMAINS]
    rows = [r for group in zip(*by_domain) for r in group][:n]
    assert len(rows) == n
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def wait_for(condition, timeout: float, what: str):
    """``condition()``'s first true value, looked for every 50 ms: a short row ends in a fraction of a
    second, and a kill must land while its shard still has rows to make."""
    deadline = time.time() + timeout
    while not (found := condition()):
        if time.time() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)
    return found


def writing(parts: Path) -> tuple[Path, int] | None:
    """A part with a finished row whose shard is still writing it, and that shard's process."""
    for journal in parts.glob("*.progress.jsonl"):
        lock = journal.with_name(journal.name[:-len(".progress.jsonl")] + ".lock")
        try:
            if journal.stat().st_size and lock.read_text().strip():
                return journal.with_name(journal.name[:-len(".progress.jsonl")]), int(lock.read_text())
        except (OSError, ValueError):  # finished between the two looks
            continue
    return None


def stop(pids: list[int], sig=signal.SIGKILL) -> None:
    """``pids`` and everything under them (a worker's flow runs start sessions of their own)."""
    for pid in [c for p in pids for c in descendants(p)] + pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class Pool:
    """A `process` work pool of the session's Prefect server with two workers started here, each in a
    session of its own; ``stop`` ends them (and the flow runs they started) and deletes the pool."""

    def __init__(self, env: dict, logs: Path):
        self.name, self.env = f"test-{uuid.uuid4().hex[:8]}", env
        subprocess.run([PREFECT, "work-pool", "create", self.name, "--type", "process"], env=env, check=True,
                       capture_output=True, timeout=120)
        self.folder, self.logs, self.workers = logs, [], []
        self.revive()

    def revive(self) -> None:
        """Two workers again: a new one for each that died."""
        self.workers = [w for w in self.workers if w.poll() is None]
        while len(self.workers) < 2:
            n = len(self.logs)
            self.logs.append(open(self.folder / f"worker-{n}.log", "w"))
            self.workers.append(subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", self.name, "--name", f"w{n}"],
                env={**self.env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "2"},
                stdout=self.logs[-1], stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> None:
        stop([w.pid for w in self.workers], signal.SIGTERM)
        for w in self.workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                stop([w.pid])
                w.wait(30)
        for f in self.logs:
            f.close()
        subprocess.run([PREFECT, "work-pool", "delete", self.name], env=self.env, capture_output=True, input="y\n",
                       text=True, timeout=60)


@pytest.fixture(scope="module")
def pool(registered, prefect_api, tmp_path_factory):
    pool = Pool(cli_env(registered, {**os.environ, **prefect_api}), tmp_path_factory.mktemp("workers"))
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def reference(registered, data_dir, prefect_api, tmp_path_factory) -> tuple[Path, list[dict]]:
    """``ROWS`` eval prompts, and a one-process `knnssd generate` of them (``TOKENS`` new tokens; batched:
    the shards' one-at-a-time rows must equal it)."""
    tmp = tmp_path_factory.mktemp("reference")
    inp, one = eval_prompts(data_dir, tmp / "eval.jsonl", ROWS), tmp / "one.parquet"
    run = subprocess.run(generate_argv(inp, one, TOKENS), env=cli_env(registered, {**os.environ, **prefect_api}),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return inp, pq.read_table(one).to_pylist()


def sharded(inp: Path, out: Path, pool: Pool, model_uri: str | None = None, tokens: int = TOKENS) -> list[str]:
    argv = generate_argv(inp, out, tokens, "1") + ["--shards", str(SHARDS), "--pool", pool.name, "--worker-wait",
                                                   "120"]
    return argv if model_uri is None else [model_uri if a == "models:/knnssd-smollm2@champion" else a for a in argv]


def moved(registered, data_dir, tmp_path) -> None:
    """``champion`` moved to a new version with another bank (its rows' ``settings`` differ)."""
    other = fixed_bank(tmp_path, data_dir, "other", lambda c: DrafterConfig(kind="ngram", max_len=3))
    steps.register(other, {"test": "moved"}, registered["uri"], alias="champion")


def test_sharded_generate_equals_one_process_through_a_killed_worker_and_a_moved_alias(registered, data_dir, pool,
                                                                                       reference, tmp_path):
    inp, single = reference
    out, parts = tmp_path / "sharded.parquet", tmp_path / "sharded.parquet.parts"
    parent = None
    try:
        with open(tmp_path / "parent.log", "w") as log:
            parent = subprocess.Popen(sharded(inp, out, pool), env=pool.env, stdout=subprocess.PIPE, stderr=log,
                                      text=True)
            wait_for(parts.is_dir, 120, "the parent made no parts folder")  # made once it pinned its version
            moved(registered, data_dir, tmp_path)  # while the shards start
            part, writer = wait_for(lambda: writing(parts), 420, "no shard made a row")
            victim = next(w for w in pool.workers if writer in descendants(w.pid))
            stop([victim.pid])  # its machine dies: the worker and the shards it runs
            victim.wait(30)
            kept = resume.read_done(part)  # what the killed shard had finished
            summary = json.loads(parent.communicate(timeout=600)[0].strip().splitlines()[-1])
        stderr = (tmp_path / "parent.log").read_text()
        assert parent.returncode == 0, stderr[-3000:]
        assert "starting it again" in stderr, stderr[-3000:]
        assert summary["rows"] == ROWS and summary["mlflow_run_id"]
        rows = pq.read_table(out).to_pylist()
        assert [r["id"] for r in rows] == [r["id"] for r in single] == [p.id for p in prompts.load(inp)]
        assert [r["tokens"] for r in rows] == [r["tokens"] for r in single]
        assert {r["settings"] for r in rows} == {r["settings"] for r in single}  # the bank the parent resolved
        assert kept and all(r == kept[r["id"]] for r in rows if r["id"] in kept)  # finished rows never redone
        assert not parts.exists() and not out.with_name(out.name + ".lock").exists()
        from mlflow import MlflowClient

        table = json.loads(Path(MlflowClient(registered["uri"]).download_artifacts(
            summary["mlflow_run_id"], "shards.json", str(tmp_path))).read_text())
        assert sorted(t["shard"] for t in table) == list(range(SHARDS)) and sum(t["rows"] for t in table) == ROWS
        assert max(t["starts"] for t in table) >= 2 and all(t["worker"] for t in table)
    finally:
        if parent is not None and parent.poll() is None:
            parent.kill()
        pool.revive()
        tracking.set_alias("smollm2", "champion", "1", registered["uri"])


def test_a_killed_parent_is_rerun_on_its_version_and_finishes_only_what_is_missing(registered, data_dir, pool,
                                                                                     reference, tmp_path):
    """The parent SIGKILLed mid-run with one of its shards (the others go on); the alias moves. A rerun by
    the alias is refused in one line (the parts hold the first version's rows); a rerun on that version
    waits for the shards still running, starts what is missing, and joins the same rows. On the
    reference's first 24 prompts at 4 tokens, the first 4 of its ``TOKENS`` (greedy: a shorter run is a
    prefix)."""
    full, reference_rows = reference
    n, tokens = 24, 4
    inp = full.with_name(f"first{n}.jsonl")
    inp.write_text("".join(full.read_text().splitlines(keepends=True)[:n]))
    single = [{**r, "tokens": r["tokens"][:tokens]} for r in reference_rows[:n]]
    out, parts = tmp_path / "o.parquet", tmp_path / "o.parquet.parts"
    with open(tmp_path / "parent.log", "w") as log:
        parent = subprocess.Popen(sharded(inp, out, pool, tokens=tokens), env=pool.env, stdout=subprocess.DEVNULL,
                                  stderr=log)
    writer = None
    try:  # both at once, from the look that saw the shard write: its next rows are still to make
        _, writer = wait_for(lambda: writing(parts), 420, "no shard made a row")
    finally:
        stop([parent.pid] + ([writer] if writer else []))
        parent.wait(30)
    kept = sum(shards.finished(shards.part_path(out, i, SHARDS)) for i in range(SHARDS))  # rows the rerun skips
    moved(registered, data_dir, tmp_path)
    try:
        refused = subprocess.run(sharded(inp, out, pool, tokens=tokens), env=pool.env, capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
        assert "was generated with other settings: bank" in refused.stderr, refused.stderr
        rerun = subprocess.run(sharded(inp, out, pool, "models:/knnssd-smollm2/1", tokens=tokens), env=pool.env,
                               capture_output=True, text=True, timeout=600)
    finally:
        tracking.set_alias("smollm2", "champion", "1", registered["uri"])
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["rows"] == n and 0 < summary["generated"] <= n - kept < n, (summary, kept)
    rows = pq.read_table(out).to_pylist()
    assert [(r["id"], r["tokens"]) for r in rows] == [(r["id"], r["tokens"]) for r in single]
    assert not parts.exists()


def test_sharded_bad_input_is_one_line_before_any_work(registered, tmp_path, prefect_api):
    """``--shards 0``, more shards than prompts, no Prefect server for the workers, a parts folder that
    cannot be made, and a pool with no worker (a wait message, then an error when the wait runs out)."""
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"Translate German to English: Hallo {i}."}) + "\n" for i in range(6)))
    out = tmp_path / "o.parquet"
    blocked = tmp_path / "blocked.parquet"
    blocked.with_name(blocked.name + ".parts").write_text("a file where the parts' folder goes")
    pool = f"empty-{uuid.uuid4().hex[:8]}"
    env = cli_env(registered, {**os.environ, **prefect_api})
    subprocess.run([PREFECT, "work-pool", "create", pool, "--type", "process"], env=env, check=True,
                   capture_output=True, timeout=120)
    gen = ["generate", "--model-uri", "models:/knnssd-smollm2@champion", "--input", str(inp), "--max-new-tokens", "4"]
    cases = [([*gen, "--output", str(out), "--shards", "0"], "--shards must be an integer from 1 to 1024, got 0"),
             ([*gen, "--output", str(out), "--shards", "7"], "--shards 7 is more than the input's 6 prompts"),
             ([*gen, "--output", str(blocked), "--shards", "2"], "cannot write the shards' parts in"),
             ([*gen, "--output", str(out), "--shards", "2", "--pool", pool, "--worker-wait", "3"],
              f"no worker came online in pool '{pool}' within 3 s; start one with `prefect worker start --pool {pool}`")]
    try:
        results = run_cli([args for args, _ in cases], env)
        no_api = run_cli([[*gen, "--output", str(out), "--shards", "2"]],
                         {k: v for k, v in env.items() if k != "PREFECT_API_URL"})
    finally:
        subprocess.run([PREFECT, "work-pool", "delete", pool], env=env, capture_output=True, input="y\n", text=True,
                       timeout=60)
    for (args, message), res in zip(cases, results):
        assert res.code == 2 and message in res.stderr[-1], (args, res)
        assert len(res.stderr) == (2 if "--worker-wait" in args else 1), res
    assert "waiting up to 3 s for a worker in pool" in results[-1].stderr[0]
    assert no_api[0].code == 2 and no_api[0].stderr == ["knnssd: error: --shards runs each shard on a work pool's "
                                                        "workers: set PREFECT_API_URL to the Prefect server they use "
                                                        "(docs/cluster.md)"], no_api
    assert sorted(x.name for x in tmp_path.iterdir()) == ["blocked.parquet.parts", "p.jsonl"]  # nothing written
