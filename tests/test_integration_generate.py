"""Routed generation: batch flow, kill + resume, and `mlflow models serve` answering /invocations."""
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import knnssd
import knnssd.flows
import knnssd.tasks
from knnssd import prompts, tracking
from knnssd.routing import bank as banks
from knnssd.engine.spec.drafters import DrafterConfig
from knnssd.engine.model.skip import SkipMask
from knnssd.search import steps
from conftest import FLOW_DTYPE
from test_integration_calibrate import fixed_bank
from cli_cases import run_cli
from servers import free_port, wait_http

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registered(tmp_path_factory, data_dir):
    """A bank built without searching (fixed configurations), registered in a fresh sqlite MLflow."""
    tmp = tmp_path_factory.mktemp("gen")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    os.environ["KNNSSD_WORK"] = str(tmp / "work")
    configs = {"reasoning": DrafterConfig(kind="hybrid", mask=SkipMask.none(30).to_dict(), max_len=6, threshold=0.5,
                                          int8=True, adaptive=True),
               "translation": DrafterConfig(kind="ngram", max_len=8, adaptive=True)}
    bank_dir = fixed_bank(tmp, data_dir, "bank", lambda c: configs[c.label])
    reg = steps.register(bank_dir, {"test": True}, uri)
    yield {"uri": uri, "reg": reg, "tmp": tmp}
    os.environ.pop("KNNSSD_WORK", None)


def eval_file(data_dir: Path, out: Path, n=3) -> Path:
    rows = []
    for d in ("reasoning", "translation"):
        rows += [json.loads(x) for x in (data_dir / f"{d}.jsonl").read_text().splitlines() if '"eval"' in x][:n]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def cli_env(registered, prefect_env: dict) -> dict:
    """The environment of a `knnssd generate` subprocess: the registered bank's MLflow, and either the
    session's Prefect server (``prefect_api``) or a PREFECT_HOME of its own (a temporary server)."""
    return {**prefect_env, "MLFLOW_TRACKING_URI": registered["uri"]}


def generate_argv(inp: Path, out: Path, max_new_tokens: int, batch_size: str = "auto") -> list[str]:
    """`knnssd generate` of the registered champion, in ``FLOW_DTYPE``, as a subprocess command line."""
    return [sys.executable, "-m", "knnssd.cli", "generate", "--model-uri", "models:/knnssd-smollm2@champion",
            "--input", str(inp), "--output", str(out), "--max-new-tokens", str(max_new_tokens), "--dtype", FLOW_DTYPE,
            "--batch-size", batch_size]


def test_batch_flow_routes_each_domain(registered, data_dir, prefect_harness, tmp_path):
    from knnssd.flows.generate import generate

    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.serving.request import GenerateRequest

    inp = eval_file(data_dir, tmp_path / "eval.jsonl")
    out = tmp_path / "out.parquet"
    request = GenerateRequest("models:/knnssd-smollm2@champion", str(inp), str(out), GenerateParams(max_new_tokens=16),
                              dtype=FLOW_DTYPE, tracking_uri=registered["uri"])
    summary = generate(request)
    table = pq.read_table(out).to_pylist()
    assert summary["rows"] == len(table) == 6 and summary["generated"] == 6
    assert all(r["label"] == r["domain"] and r["new_tokens"] > 0 for r in table)
    assert summary["mlflow_run_id"] and summary["route_overhead_pct"] < 5
    # a rerun has nothing left to do
    again = generate(request)
    assert again["generated"] == 0 and again["rows"] == 6


def count_calls(monkeypatch, functions: dict[str, object], methods: dict[str, tuple[type, str]]) -> Counter:
    """Count each call of ``functions`` wherever a knnssd module binds one (its own module, and every
    ``from ... import`` of it), and of ``methods`` on their classes; each still does its work."""
    calls = Counter()

    def spy(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in functions.items():
        for module in [m for n, m in sys.modules.items() if n.split(".")[0] == "knnssd"]:
            for attr, value in list(vars(module).items()):
                if value is fn:
                    monkeypatch.setattr(module, attr, spy(name, fn))
    for name, (cls, attr) in methods.items():
        monkeypatch.setattr(cls, attr, spy(name, getattr(cls, attr)))
    return calls


def test_a_generate_request_runs_each_check_once(registered, data_dir, tmp_path, prefect_harness, monkeypatch):
    """Issue 65: `generate` checked at each layer (the CLI, then the flow, then the batch): the limits, the
    output's settings and its lock twice each, the paths three times. Through the CLI's handler, the flow,
    its task and the batch, each check runs once, and the prompts and the output are read once."""
    from knnssd.cli import parser
    from knnssd.engine.spec.request_params import Limits, check_prompt
    from knnssd.serving import output_paths, request, resume

    monkeypatch.setattr(tracking, "_reachable", set())  # as in a new process: no store checked yet
    calls = count_calls(monkeypatch, {
        "prompts": prompts.load, "rows": request.check_rows, "each prompt": check_prompt,
        "paths": output_paths.check_paths, "lock": output_paths._lock, "tracking store": tracking._check_sqlite,
        "settings": resume.check_output, "finished rows": resume.read_done},
        {"limits": (Limits, "check"), "slots": (Limits, "check_slots")})
    inp, out = eval_file(data_dir, tmp_path / "eval.jsonl", n=2), tmp_path / "out.parquet"
    a = parser().parse_args(["generate", "--model-uri", "models:/knnssd-smollm2@champion", "--input", str(inp),
                             "--output", str(out), "--max-new-tokens", "4", "--dtype", FLOW_DTYPE, "--batch-size", "2",
                             "--tracking-uri", registered["uri"]])
    assert a.fn(a) == 0
    assert dict(calls) == {**{name: 1 for name in ("prompts", "rows", "paths", "lock", "tracking store", "settings",
                                                   "finished rows", "limits", "slots")}, "each prompt": 4}
    assert sorted(r["id"] for r in pq.read_table(out).to_pylist()) == sorted(p.id for p in prompts.load(inp))


def test_sigkill_mid_batch_then_rerun_has_every_id_once(registered, data_dir, tmp_path, prefect_api):
    """A second run on the same output refuses at once, naming the first; the first, SIGKILLed mid-batch,
    leaves no process, temp file or lock behind; a rerun completes with every id exactly once."""
    inp = eval_file(data_dir, tmp_path / "eval.jsonl", n=5)
    out = tmp_path / "out.parquet"
    args = generate_argv(inp, out, max_new_tokens=24, batch_size="3")  # 10 prompts through 3 slots: killed mid-batch
    env = cli_env(registered, {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")})  # its own temporary server
    rerun_env = cli_env(registered, {**os.environ, **prefect_api})  # the session's server: no temporary one to start
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lock = out.with_name(out.name + ".lock")
    deadline = time.time() + 120
    while time.time() < deadline and not (lock.exists() and lock.read_text()):
        time.sleep(0.1)
    second = subprocess.run(args, env=rerun_env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2
    assert second.stderr.strip().splitlines()[-1] == (f"knnssd: error: {out.resolve()} is being written by process "
                                                       f"{proc.pid}; wait for it or choose another --output")
    journal = out.with_name(out.name + ".progress.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
    children = descendants(proc.pid)
    assert children, "the run's temporary Prefect server should be a child process"
    tmp_before = set(Path(tempfile.gettempdir()).glob("knnssd-*"))
    proc.send_signal(signal.SIGKILL)  # the process alone, not its group: its children must stop by themselves
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and any(alive(c) for c in children):
        time.sleep(0.2)
    assert not [c for c in children if alive(c)], "a child outlived the SIGKILLed run"
    assert set(Path(tempfile.gettempdir()).glob("knnssd-*")) <= tmp_before
    assert not out.with_name(out.name + ".lock").exists() or not _locked(out)
    if out.exists():
        pq.read_table(out)  # never torn
    done = run = subprocess.run(args, env=rerun_env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    ids = [r["id"] for r in pq.read_table(out).to_pylist()]
    assert sorted(ids) == sorted(p.id for p in prompts.load(inp)) and len(ids) == len(set(ids))
    assert json.loads(done.stdout.strip().splitlines()[-1])["generated"] < 10
    assert not journal.exists() and not lock.exists()


def descendants(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _locked(out: Path) -> bool:
    from knnssd.serving import output_paths

    try:
        with output_paths.writing(out):
            return False
    except output_paths.OutputError:
        return True


def test_generate_bad_input_is_one_line(registered, data_dir, tmp_path, prefect_api):
    """One line, in seconds, before any server starts or model loads, with no retry and no traceback."""
    inp = eval_file(data_dir, tmp_path / "eval.jsonl", n=1)
    bank = tmp_path / "bank"
    bank.mkdir()
    (bank / "bank.json").write_text('{"format": ')
    cases = [
        (["--input", "/nonexistent.jsonl"], "prompt file not found"),
        (["--model-uri", "models:/knnssd-nope@champion"], "no alias 'champion'"),
        (["--model-uri", "models:/knnssd-smollm2@nobody"], "no alias 'nobody'"),
        (["--model-uri", "models:/knnssd-smollm2/99"], "no version 99"),
        (["--model-uri", "knnssd-smollm2"], "neither models:/"),
        (["--max-new-tokens", "0"], "must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be 'auto' or an integer >= 1"),
        (["--tracking-uri", "http://127.0.0.1:9"], "does not answer"),
        (["--model-uri", str(bank)], "is corrupt"),
    ]
    argvs = []
    for args, _ in cases:
        argv = ["generate", "--model-uri", "models:/knnssd-smollm2@champion", "--input", str(inp), "--output",
                str(tmp_path / "o.parquet"), "--max-new-tokens", "4", "--batch-size", "auto", "--tracking-uri",
                registered["uri"]]
        for k, v in zip(args[::2], args[1::2]):
            argv[argv.index(k) + 1] = v
        argvs.append(argv)
    for (args, message), res in zip(cases, run_cli(argvs, cli_env(registered, {**os.environ, **prefect_api}))):
        assert res.code == 2 and len(res.stderr) == 1, (args, res)
        assert res.stderr[0].startswith("knnssd: error:") and message in res.stderr[0], (args, res)
        assert res.seconds < 15, (args, res)  # the reachability check's 5 s at most
    assert not (tmp_path / "o.parquet").exists()


@pytest.fixture(scope="module")
def routed(registered):
    """The registered champion's generator in ``FLOW_DTYPE``: the one the generate flow called in this process uses."""
    from knnssd.serving.request import GenerateRequest

    return GenerateRequest("models:/knnssd-smollm2@champion", "-", "-", dtype=FLOW_DTYPE,
                           tracking_uri=registered["uri"]).generator()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job(inp, out, params, batch_size: int | None = None):
    """A ``GenerateRequest`` of ``inp`` into ``out``, for ``batch.run`` with a generator of the test's own."""
    from knnssd.serving.request import GenerateRequest

    return GenerateRequest("models:/knnssd-smollm2@champion", str(inp), str(out), params, batch_size=batch_size)


def test_resume_regenerates_changed_prompts_and_refuses_other_settings(registered, routed, data_dir, tmp_path,
                                                                        prefect_api, caplog):
    """Issue 40, defects 1 and 4. A prompt put in front of an input without ids is generated alone, and
    every row keeps its own prompt's answer; a prompt changed under an explicit id is generated again
    (warned); other parameters or another bank are refused in one line, before any model loads."""
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.serving import batch, resume
    from knnssd.serving.routed import RoutedGenerator

    texts = [p.prompt for p in prompts.load(eval_file(data_dir, tmp_path / "eval.jsonl", n=2))]
    params = GenerateParams(max_new_tokens=4)
    inp, out = tmp_path / "p.jsonl", tmp_path / "o.parquet"
    _jsonl(inp, [{"prompt": t} for t in texts[1:]])
    assert batch.run(job(inp, out, params, 1), routed, prompts.load(inp)).generated == 3
    _jsonl(inp, [{"prompt": t} for t in texts])
    assert batch.run(job(inp, out, params, 1), routed, prompts.load(inp)).generated == 1
    table = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    for p in prompts.load(inp):
        assert table[p.id]["prompt_hash"] == resume.prompt_hash(p.prompt)
    first = prompts.load(inp)[0]
    assert table[first.id]["tokens"] == routed.generate(first.prompt, params).tokens  # its own answer

    named = _jsonl(tmp_path / "named.jsonl", [{"id": "q1", "prompt": texts[0]}, {"id": "q2", "prompt": texts[1]}])
    out2 = tmp_path / "named.parquet"
    batch.run(job(named, out2, params, 1), routed, prompts.load(named))
    _jsonl(named, [{"id": "q1", "prompt": texts[0]}, {"id": "q2", "prompt": texts[2]}])
    with caplog.at_level("WARNING"):
        assert batch.run(job(named, out2, params, 1), routed, prompts.load(named)).generated == 1
    assert "1 row(s) hold the answer to another prompt under the same id" in caplog.text
    assert {r["id"]: r["prompt_hash"] for r in pq.read_table(out2).to_pylist()}["q2"] == resume.prompt_hash(texts[2])

    before = out.read_bytes()
    argv = ["generate", "--model-uri", "models:/knnssd-smollm2@champion", "--input", str(inp), "--output", str(out),
            "--dtype", FLOW_DTYPE, "--tracking-uri", registered["uri"]]
    res, = run_cli([argv + ["--max-new-tokens", "24", "--temperature", "0.9"]],
                   cli_env(registered, {**os.environ, **prefect_api}))
    assert res.code == 2 and len(res.stderr) == 1, res
    assert "max_new_tokens 4 (this run: 24)" in res.stderr[0] and "--overwrite" in res.stderr[0], res
    assert res.seconds < 15 and out.read_bytes() == before
    # the same command again, with nothing left to generate: said at once, with no server, model load or write
    res, = run_cli([argv + ["--max-new-tokens", "4"]], cli_env(registered, {**os.environ, **prefect_api}))
    assert res.code == 0 and res.stderr == [f"knnssd: every prompt of {inp} is in {out} already"], res
    assert res.seconds < 15 and out.read_bytes() == before

    other = tmp_path / "other-bank"
    shutil.copytree(tracking.download_bank("models:/knnssd-smollm2@champion", uri=registered["uri"]), other)
    b = banks.load(other)
    b.clusters[0].speedup += 1
    b.save(other)
    with pytest.raises(batch.OutputError, match=r"bank \w+ \(this run: \w+\)"):
        batch.run(job(inp, out, params), RoutedGenerator(routed.lm, banks.load(other)), prompts.load(inp))
    assert out.read_bytes() == before

    link = tmp_path / "link.parquet"  # resumed through a symbolic link: its target is, the link stays
    link.symlink_to(out)
    _jsonl(inp, [{"prompt": t} for t in texts] + [{"prompt": "Translate German to English:\nDanke."}])
    assert batch.run(job(inp, link, params, 1), routed, prompts.load(inp)).generated == 1
    assert link.is_symlink() and pq.read_table(out).num_rows == 5


def test_limits_are_checked_before_any_work(registered, routed, tmp_path, prefect_api, caplog):
    """Issue 40, defects 5 and 7: a billion new tokens is one line before the model loads (it tried to
    allocate 384 GB after the load, in 226 lines, and left an empty journal); a prompt longer than the
    model's 8,192 positions is cut to fit with a warning, whatever ``--max-prompt-tokens`` says. From its
    trials: the same for the searches and promote (a calibration ran for 10 minutes), a pooling layer the
    model lacks, and a batch size that cannot fit (it was refused after the load)."""
    from knnssd.engine.spec.request_params import GenerateParams

    inp = _jsonl(tmp_path / "p.jsonl", [{"prompt": "Hello"}])
    many = _jsonl(tmp_path / "many.jsonl", [{"prompt": f"Hello {i}"} for i in range(30)])
    out = tmp_path / "o.parquet"
    temp = tmp_path / "tmp"  # the commands' own temp folder: nothing may be left there (torchinductor's was)
    temp.mkdir()
    cases = [(["generate", "--model-uri", "models:/knnssd-smollm2@champion", "--input", str(inp), "--output", str(out),
               "--tracking-uri", registered["uri"], "--max-new-tokens", "1000000000"],
              "must be below the model's context of 8192 tokens"),
             (["complete", "--prompt", "Hello", "--max-new-tokens", "8192"],
              "must be below the model's context of 8192 tokens"),
             (["calibrate", "--layer", "99", "--tracking-uri", registered["uri"]],
              "pooling layer 99 is outside the model's 30 layers"),
             (["calibrate", "--max-new-tokens", "100000", "--tracking-uri", registered["uri"]], "context of 8192"),
             (["add-domain", "--name", "x", "--input", str(inp), "--max-new-tokens", "100000", "--tracking-uri",
               registered["uri"]], "context of 8192"),
             (["promote", "--max-new-tokens", "100000", "--tracking-uri", registered["uri"]], "context of 8192"),
             (["generate", "--model-uri", "models:/knnssd-smollm2@champion", "--input", str(many), "--output", str(out),
               "--tracking-uri", registered["uri"], "--max-new-tokens", "8000", "--batch-size", "100"],
              "sequences of 8001 positions whose KV cache fits the 4 GiB budget")]  # 23 in bf16, 11 in fp32
    env = {**cli_env(registered, {**os.environ, **prefect_api}), "TMPDIR": str(temp)}
    for (_, message), res in zip(cases, run_cli([args for args, _ in cases], env)):
        assert res.code == 2 and len(res.stderr) == 1, res
        assert message in res.stderr[0] and res.seconds < 15, res
    assert sorted(x.name for x in tmp_path.iterdir()) == ["many.jsonl", "p.jsonl", "tmp"]  # no output, journal, lock
    assert not list(temp.iterdir())

    params = GenerateParams(max_new_tokens=8, max_prompt_tokens=100_000)
    with caplog.at_level("WARNING"):
        ids, truncated = routed.tokenize("word " * 12_000, params)
    assert truncated and len(ids) == 8192 - 8
    assert "truncated to its last 8184 (the most that fits with 8 new tokens)" in caplog.text
    assert routed.positions(["word " * 12_000], params) == 8192


def test_batch_size_over_the_kv_budget_is_refused(routed, tmp_path):
    """Issue 40, defect 6, and its trial: ``KNNSSD_BATCH_SIZE=100000`` never started the server (planning
    100,000 slots), and ``generate --batch-size 100000`` on 2 prompts ran out of memory after 3 min 41 s.
    A batch takes no more slots than prompts, and a size over the KV-cache budget is one line."""
    from knnssd.engine.batch.plan import check_slots
    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.serving import batch

    for name in ("KNNSSD_BATCH_SIZE", "--batch-size"):
        with pytest.raises(ValueError, match=rf"{name} 100000 is more than the \d+ sequences of 4224 positions"):
            check_slots(routed.decoder, 100_000, 4224, name)
    check_slots(routed.decoder, 4, 4224, "--batch-size")
    rows = [prompts.Prompt(f"p{i}", f"Translate German to English: Guten Tag {i}.") for i in range(2)]
    summary = batch.run(job(tmp_path / "p.jsonl", tmp_path / "o.parquet", GenerateParams(max_new_tokens=2), 100_000),
                        routed, rows)
    assert summary.batch_size == 2 and summary.rows == 2


@pytest.fixture
def small_disk(tmp_path):
    """A file system of 256 KiB (a tmpfs; mounting one needs root)."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a small file system needs root to mount a tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_full_disk_is_one_line_and_the_rerun_resumes(registered, routed, data_dir, tmp_path, prefect_api,
                                                        small_disk):
    """Issue 40, defect 9: a full disk under the output gave a 169-line traceback (and a retry). Now one
    line names the file and what is kept, nothing is left in the folder but the output and its journal,
    and the rerun, once there is room, generates only the rest."""
    import re
    import shutil as sh

    from knnssd.engine.spec.request_params import GenerateParams
    from knnssd.serving import batch

    inp = eval_file(data_dir, tmp_path / "eval.jsonl", n=5)
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (sh.disk_usage(small_disk).free - 2 * 4096))  # the lock and one page of journal
    out = small_disk / "o.parquet"
    run = subprocess.run(generate_argv(inp, out, 8, "1"), env=cli_env(registered, {**os.environ, **prefect_api}),
                         capture_output=True, text=True, timeout=600)
    lines = [x for x in run.stderr.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("generate:")]
    assert run.returncode == 2 and len(lines) == 1, run.stderr[-3000:]
    kept = re.fullmatch(r"knnssd: error: cannot write \S+ \(No space left on device\); the (\d+) row\(s\) finished "
                        r"so far are kept: make room and run the same command again to resume", lines[0])
    assert kept, lines[0]
    assert {x.name for x in small_disk.iterdir()} <= {"filler", "o.parquet", "o.parquet.progress.jsonl"}
    filler.unlink()
    summary = batch.run(job(inp, out, GenerateParams(max_new_tokens=8), 1), routed, prompts.load(inp))
    assert summary.rows == 10 and summary.generated == 10 - int(kept.group(1))
    assert sorted(r["id"] for r in pq.read_table(out).to_pylist()) == sorted(p.id for p in prompts.load(inp))


def test_bad_prompt_files_and_existing_outputs(registered, tmp_path):
    from knnssd.serving import resume
    from knnssd.serving.request import check_rows

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(prompts.PromptError, match="not UTF-8"):
        prompts.load(bad)
    bad.write_text('{"text": "hi"}\n')
    with pytest.raises(prompts.PromptError, match="no 'prompt' field"):
        prompts.load(bad)
    bad.write_text("")
    with pytest.raises(prompts.PromptError, match="no rows"):
        prompts.load(bad)
    with pytest.raises(ValueError, match="prompt 'x' is empty"):
        check_rows([prompts.Prompt("x", "  ")])
    other = tmp_path / "other.parquet"
    import pyarrow as pa

    pq.write_table(pa.table({"a": [1]}), other)
    with pytest.raises(resume.OutputError, match="not a knnssd generation output"):
        resume.read_done(other)
    assert pq.read_table(other).num_rows == 1  # untouched


def test_foreign_bank_is_refused(registered):
    from knnssd.routing import bank as banks
    from knnssd.serving.routed import RoutedGenerator

    folder = tracking.download_bank("models:/knnssd-smollm2@champion", uri=registered["uri"])
    b = banks.load(folder)
    b.fingerprint = "0000"
    b.save(folder)
    with pytest.raises(banks.BankError, match="fingerprint"):
        RoutedGenerator.from_bank_dir(folder, dtype=FLOW_DTYPE)


UNMATCHED = "Lorem ipsum dolor sit amet"  # far from every anchor of the test bank (similarity 0.20, the bar 0.33)


def strict_json(body: bytes):
    """``json.loads`` that refuses NaN and Infinity, as JavaScript's ``JSON.parse`` does."""
    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    return json.loads(body, parse_constant=refuse)


def test_mlflow_models_serve_refuses_bad_settings_in_one_line(registered, tmp_path):
    """Issue 40, defect 10: ``KNNSSD_DTYPE=float16`` (and ``KNNSSD_BATCH_SIZE=abc``, ``KNNSSD_DEVICE=cuda``)
    ended the server with 100-147 lines of tracebacks, the float16 one blaming the attention kernel. Now
    knnssd says why in one line, before the model loads, and the server exits with status 2 (``mlflow
    models serve`` then reports that status in its own lines)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "MLFLOW_TRACKING_URI": registered["uri"], "KNNSSD_DTYPE": "float16",
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    run = subprocess.run([str(Path(bin_dir) / "mlflow"), "models", "serve", "-m", "models:/knnssd-smollm2@champion",
                          "--env-manager", "local", "-h", "127.0.0.1", "-p", str(free_port())], env=env,
                         capture_output=True, text=True, timeout=180)
    lines = run.stderr.splitlines()
    assert run.returncode != 0 and "Return code = 2" in run.stderr, run.stderr[-3000:]
    assert [x for x in lines if x.startswith("knnssd")] == [
        "knnssd: error: KNNSSD_DTYPE='float16' is not one of auto, bfloat16, float32, gguf, q4_1, q8_0"], run.stderr[-3000:]
    frames = [x for x in lines if x.strip().startswith('File "')]
    # knnssd's own code by its folders: a checkout named knnssd (what git clone makes) holds MLflow's frames too
    own = tuple(f'File "{Path(m.__file__).parent}{os.sep}' for m in (knnssd, knnssd.flows, knnssd.tasks))
    assert not [x for x in frames if "uvicorn" in x or x.strip().startswith(own)], run.stderr[-3000:]  # MLflow's alone
    assert not any("Loading weights" in x for x in lines)


def test_mlflow_models_serve_answers_invocations(registered, tmp_path):
    port = free_port()
    bin_dir = str(Path(sys.executable).parent)  # mlflow starts uvicorn from PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": registered["uri"], "KNNSSD_DTYPE": FLOW_DTYPE, "KNNSSD_BATCH_SIZE": "4",
           "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    mlflow_bin = str(Path(bin_dir) / "mlflow")
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([mlflow_bin, "models", "serve", "-m", "models:/knnssd-smollm2@champion",
                               "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port)], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/ping", 240, server)
        body = json.dumps({"dataframe_records": [{"prompt": "Question: What is 12 + 30?\nAnswer:"},
                                                 {"prompt": "Translate German to English:\nGuten Morgen, Welt."}],
                           "params": {"max_new_tokens": 12}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            preds = json.loads(r.read())["predictions"]
        assert len(preds) == 2 and all(p["new_tokens"] == 12 or p["stop"] == "eos" for p in preds)
        assert {"text", "label", "acceptance_rate", "route_ms"} <= set(preds[0])

        def ask(records, params):
            body = json.dumps({"dataframe_records": records, "params": params}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", body,
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    return r.status, strict_json(r.read())
            except urllib.error.HTTPError as e:
                return e.code, strict_json(e.read())

        # a prompt no anchor matches beside one that matches: clusters are integers or null, never NaN
        code, answer = ask([{"prompt": UNMATCHED}, {"prompt": "Translate German to English:\nGuten Morgen."}],
                           {"max_new_tokens": 2})
        clusters = [p["cluster"] for p in answer["predictions"]]
        assert code == 200 and clusters[0] is None and isinstance(clusters[1], int), answer

        # 10 requests at once (decoded together, 4 slots) get exactly their one-at-a-time answers
        records = [[{"prompt": f"Translate German to English: Guten Morgen Nummer {i}."}] for i in range(10)]
        sequential = [ask(r, {"max_new_tokens": 8}) for r in records]
        with ThreadPoolExecutor(10) as pool:
            concurrent = list(pool.map(lambda r: ask(r, {"max_new_tokens": 8}), records))
        texts = lambda answers: [(code, a["predictions"][0]["tokens"]) for code, a in answers]  # noqa: E731
        assert texts(concurrent) == texts(sequential) and all(code == 200 for code, _ in sequential)

        # bad requests: 400 with the reason in the message
        for recs, params, reason in (
            (records[0], {"max_new_tokens": -1}, "max_new_tokens"),
            (records[0], {"temperature": float("nan")}, "temperature=nan"),
            (records[0], {"top_p": float("inf")}, "top_p=inf"),
            ([], {}, "no prompts"),
            ([{"text": "hi"}], {}, "'prompt' field"),
            (records[0], {"max_new_tokens": 1_000_000_000}, "must be below the model's context of 8192 tokens"),
            (records[0], {"temperature": 0.5, "seed": 2**70}, "seed must be in [0, 2**64)"),
            (records[0], {"temperature": 1e-300}, "temperature must be 0 (greedy) or at least 1e-06"),
            ([{"prompt": None}, {"prompt": "hi"}], {}, "prompt must be text, got null"),
        ):
            code, answer = ask(recs, params)
            assert code == 400 and reason in answer["message"] and "stack_trace" not in answer, (params, answer)

        # trial 4, D6: a SIGTERM to the group left uvicorn decoding a request nobody would read, for 20-80 s
        from knnssd.processes import group_members

        pool = ThreadPoolExecutor(1)
        pool.submit(ask, [{"prompt": "Count from 1 to 5000: 1, 2, 3, 4, 5, 6,"}], {"max_new_tokens": 2000})
        time.sleep(2)
        os.killpg(server.pid, signal.SIGTERM)
        start = time.monotonic()
        while group_members(server.pid) and time.monotonic() - start < 60:
            server.poll()
            time.sleep(0.2)
        assert not group_members(server.pid) and time.monotonic() - start < 10, time.monotonic() - start
        pool.shutdown(wait=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
        log.close()
        print((tmp_path / "serve.log").read_text()[-3000:])
