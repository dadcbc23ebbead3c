"""Inputs caught early and dependencies that fail fast (issue: reliability). No model loads here."""
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from knnssd import tracking
from knnssd.engine.spec.request_params import GenerateParams, check_prompt
from knnssd.engine.spec.sampling import Warp
from knnssd.serving import batch, output_paths
from cli_cases import Stopwatch, run_cli


@pytest.mark.parametrize("field,value", [
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", -1.0),
    ("top_p", math.nan), ("top_p", math.inf), ("top_p", 0.0),
    ("top_k", math.nan), ("max_new_tokens", 0), ("max_new_tokens", -5), ("max_new_tokens", math.nan),
    ("max_new_tokens", "8"), ("seed", 1.5), ("seed", 2**70), ("seed", -2), ("temperature", 1e-300), ("temperature", 1e-7),
])
def test_bad_generation_parameters_are_one_line_errors(field, value):
    with pytest.raises(ValueError) as e:
        GenerateParams.from_dict({field: value})
    assert "\n" not in str(e.value) and field.split("_")[0] in str(e.value)


def test_good_generation_parameters_pass():
    p = GenerateParams.from_dict({"max_new_tokens": 8.0, "temperature": 0.7, "top_p": 0.9, "seed": -1})
    assert p.max_new_tokens == 8 and p.seed is None and p.warp == Warp(0.7, 0, 0.9)


@pytest.mark.parametrize("prompt,message", [
    ("caf\udce9", "not valid UTF-8"), ("   ", "empty prompt"), (None, "must be text, got null"),
    (math.nan, "must be text, got null"), (3, "must be text, got int"),
])
def test_bad_prompts_are_one_line_errors(prompt, message):
    with pytest.raises(ValueError, match=message):
        check_prompt(prompt)


def _hold(output, seconds=60):
    code = textwrap.dedent(f"""
        import sys, time
        from knnssd.serving import batch
        with batch.writing({str(output)!r}):
            print("held", flush=True)
            time.sleep({seconds})
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_one_writer_per_output_and_sigkill_releases_it(tmp_path):
    out = tmp_path / "out.parquet"
    holder = _hold(out)
    try:
        with pytest.raises(batch.OutputError, match=f"being written by process {holder.pid}"):
            with batch.writing(out):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with batch.writing(out):  # the kernel released the flock with the killed holder
        with batch.writing(out):  # re-entrant within one process (the CLI holds it around the flow)
            pass
    assert not batch.lock_path(out).exists()


def test_a_second_generate_on_one_output_is_refused_before_any_bank_or_model_loads(tmp_path):
    """Trial 6: a second ``generate`` on an output being written took 39 s to be refused on a loaded machine.
    The lock is taken before the bank: here the bank URI names nothing, and the refusal names the holder."""
    inp, out = tmp_path / "x.jsonl", tmp_path / "out.parquet"
    inp.write_text('{"prompt": "Hello"}\n')
    holder = _hold(out)
    try:
        _one_line_each([(["generate", "--model-uri", str(tmp_path / "no-bank"), "--input", str(inp), "--output",
                          str(out)], f"being written by process {holder.pid}")], _cli_env(tmp_path), seconds=5)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not out.exists()


def test_the_cli_leaves_ignored_signals_and_host_handlers_alone():
    """``cli._signals_unwind`` raises ``Terminated`` only for signals left at their default: an ignored
    SIGHUP (``nohup``) stays ignored, a default SIGTERM is taken for the command, and every handler is
    as before once it ends."""
    from knnssd import cli

    before = {s: signal.getsignal(s) for s in cli.UNWIND}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with cli._signals_unwind():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_unreachable_or_unwritable_tracking_fails_in_seconds(tmp_path):
    watch = Stopwatch()
    with pytest.raises(tracking.RegistryError, match="does not answer"):
        tracking.check_reachable("http://127.0.0.1:9")
    assert watch.seconds() < 15
    with pytest.raises(tracking.RegistryError, match="cannot be written"):
        tracking.check_reachable("sqlite:////proc/x.db")
    (tmp_path / "ok").mkdir()
    tracking.check_reachable(f"sqlite:///{tmp_path / 'ok' / 'mlflow.db'}")


def test_tracking_uris_that_cannot_work_are_one_line_errors(tmp_path, monkeypatch):
    """Issue 40, defects 8, 11 and 14: an unsupported scheme (ftp:// gave a traceback), a damaged
    database (truncated, or pages overwritten: an 86-line traceback), and a mistyped sqlite path (its
    folders and a 954 kB database were created) are each one line; only the default database's folder
    is created."""
    import sqlite3

    with pytest.raises(tracking.RegistryError, match="MLflow does not take 'ftp:'"):
        tracking.check_reachable("ftp://example.org/mlflow")
    for uri in ("postgresql://u:p@127.0.0.1:1/db", "mysql://u:p@127.0.0.1:1/db"):  # no driver here, or no server
        with pytest.raises(tracking.RegistryError, match="cannot be opened"):
            tracking.check_reachable(uri)
    missing = tmp_path / "no" / "such" / "folder" / "mlflow.db"
    with pytest.raises(tracking.RegistryError, match="does not exist"):
        tracking.check_reachable(f"sqlite:///{missing}")
    assert not (tmp_path / "no").exists()
    monkeypatch.setenv("KNNSSD_WORK", str(tmp_path / "work"))  # the default database: made where it is missing
    tracking.check_reachable(f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    assert (tmp_path / "work").is_dir()

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
        con.executemany("INSERT INTO runs (name) VALUES (?)", [("run %d " % i * 20,) for i in range(3000)])
    size = db.stat().st_size
    tracking.check_reachable(f"sqlite:///{db}")
    for name, damage in (("truncated", lambda f: f.truncate(size // 2)),
                         ("overwritten", lambda f: (f.seek(size // 3), f.write(os.urandom(8192))))):
        bad = tmp_path / f"{name}.db"
        bad.write_bytes(db.read_bytes())
        with open(bad, "r+b") as f:
            damage(f)
        before = bad.read_bytes()
        with pytest.raises(tracking.RegistryError, match="is damaged") as e:
            tracking.check_reachable(f"sqlite:///{bad}")
        assert "\n" not in str(e.value) and bad.read_bytes() == before, name  # nothing written to it


def test_prefect_api_that_does_not_answer_fails_in_seconds():
    from knnssd.flows.server import PrefectUnavailable, check

    watch = Stopwatch()
    with pytest.raises(PrefectUnavailable, match="does not answer"):
        check("http://127.0.0.1:9/api")
    assert watch.seconds() < 15


def test_input_errors_are_not_retried():
    import errno

    from prefect.states import Failed

    from knnssd.tasks.retry import transient

    assert not transient(None, None, Failed(data=ValueError("empty prompt")))
    assert not transient(None, None, Failed(data=FileNotFoundError("x")))
    assert not transient(None, None, Failed(data=OSError(errno.ENOSPC, "No space left on device")))
    assert transient(None, None, Failed(data=OSError("disk hiccup")))
    from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

    # an alias MLflow refused at registration was retried twice, each try leaving a version without an alias
    assert not transient(None, None, Failed(data=MlflowException("bad alias", INVALID_PARAMETER_VALUE)))
    assert transient(None, None, Failed(data=MlflowException("database is locked")))


def test_cli_rejects_bad_sampling_and_prompts_before_loading(tmp_path):
    """`complete`, `generate` and the benchmarks answer in one line, with no model load (seconds, not a
    minute)."""
    env = {**os.environ, "KNNSSD_WORK": str(tmp_path / "work"), "PREFECT_HOME": str(tmp_path / "prefect")}
    inp = tmp_path / "p.jsonl"
    inp.write_text('{"prompt": "Hello"}\n')
    cases = [
        (["complete", "--prompt", "hi", "--temperature", "nan"], "temperature=nan"),
        (["complete", "--prompt", "hi", "--top-p", "inf"], "top_p=inf"),
        (["complete", "--prompt", "hi", "--max-new-tokens", "0"], "must be >= 1"),
        (["complete", "--prompt", b"caf\xe9"], "not valid UTF-8"),
        (["generate", "--model-uri", str(tmp_path), "--input", str(inp), "--output", str(tmp_path / "o.parquet"),
          "--temperature", "inf"], "temperature=inf"),
        (["generate", "--model-uri", str(tmp_path), "--input", str(inp), "--output", str(tmp_path),
          ], "is a folder"),
        (["generate", "--model-uri", str(tmp_path), "--input", str(inp), "--output", str(tmp_path / "o.parquet"),
          "--device", "gpu0"], "unknown device 'gpu0'"),
        (["bench-throughput", "--bank", str(tmp_path), "--device", "gpu0"], "unknown device 'gpu0'"),
        (["bench", "--bank", str(tmp_path), "--device", "gpu0"], "unknown device 'gpu0'"),
        (["bench", "--bank", str(tmp_path), "--throughput", "2", "--throughput-sizes", "1"],
         "each >= 2"),
        (["bench-throughput", "--bank", str(tmp_path), "--prompts", "0"], "prompts (0)"),
        (["bench-throughput", "--bank", str(tmp_path), "--sizes", ""], "batch sizes must be one or more"),
        (["bench", "--bank", str(tmp_path), "--throughput", "2", "--throughput-sizes", "2", "--flow",
          "--repeats", "0"], "repeats must be >= 1"),
        # a probability of switching domain out of [0, 1] ran the whole stream; a folder that cannot be made
        # failed after the banks and the model loaded, without naming --out
        (["bench", "--bank", str(tmp_path), "--ratios", "0.3,2"], "each in [0, 1], got 0.3,2.0"),
        (["bench", "--bank", str(tmp_path), "--ratios", "nan"], "each in [0, 1]"),
        (["bench", "--bank", str(tmp_path), "--ratios", ""], "--ratios takes one or more numbers"),
        (["bench", "--bank", str(tmp_path), "--out", "/proc/x/y"], "cannot make the results folder /proc/x/y (--out)"),
        (["calibrate", "--device", "gpu0"], "unknown device 'gpu0'"),
        # trial 6, D6: a bench that failed on its bank left an empty artifacts/bench in the folder it ran from
        (["bench", "--bank", str(tmp_path / "no-bank")], "no-bank"),
    ]
    for (args, message), res in zip(cases, run_cli([args for args, _ in cases], env)):
        assert res.code == 2 and len(res.stderr) == 1 and message in res.stderr[0], (args, res)
        assert res.seconds < 30, args
    assert not list(tmp_path.glob("*.progress.jsonl")) and not list(tmp_path.glob("*.lock"))
    assert not (tmp_path / "work" / "bench").exists()


# --- issue 40: resume, inputs, limits, settings and faults, each case without a model ----------------------------------

def _row(pid: str, prompt: str, settings: dict, **over) -> dict:
    """A finished output row as ``batch._run`` writes it."""
    row = {"id": pid, "domain": None, "text": "x", "tokens": [1, 2], "new_tokens": 2, "cluster": None, "label": "plain AR",
           "similarity": 0.1, "matched": False, "drafter": "plain AR", "acceptance_rate": 0.0, "mean_accepted": 1.0,
           "steps": 2, "drafted": 0, "accepted": 0, "latency_s": 0.1, "route_ms": 0.2, "tokens_per_s": 20.0,
           "prompt_tokens": 3, "truncated": False, "stop": "length", "prompt_hash": batch.prompt_hash(prompt),
           "settings": batch._settings_text(settings)}
    return {**row, **over}


def _settings(**params) -> dict:
    from types import SimpleNamespace

    return batch.run_settings(GenerateParams(**params), "bfloat16", SimpleNamespace(digest="b1"))


def test_ids_of_rows_without_one_follow_the_prompt_not_its_position(tmp_path):
    """Defect 1: auto ids were positional (``<file>-00000``), so a prompt put in front of the others took
    the first id, and a resume paired it with the old first prompt's answer."""
    from knnssd import prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "b"}\n{"prompt": "c"}\n{"prompt": "b"}\n')
    before = {r.prompt + str(i): r.id for i, r in enumerate(prompts.load(path))}
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n{"prompt": "b"}\n')
    after = [r.id for r in prompts.load(path)]
    assert after[1:] == [before["b0"], before["c1"], before["b2"]]  # the same prompts keep their ids
    assert after[0] not in before.values() and len(set(after)) == 4 and after[3] == after[1] + "-2"


def test_resume_refuses_other_settings_and_names_them(tmp_path):
    """Defect 4: a rerun with other parameters reported ``"generated": 0`` and kept the old rows."""
    out = tmp_path / "o.parquet"
    made = _settings(max_new_tokens=8)
    batch.write_parquet([_row("a", "p", made)], out)
    assert set(batch.check_output(out, False, settings=made)) == {"a"}
    with pytest.raises(batch.OutputError) as e:
        batch.check_output(out, False, settings=_settings(max_new_tokens=24, temperature=0.9, seed=3))
    message = str(e.value)
    assert "\n" not in message and "--overwrite" in message
    assert "max_new_tokens 8 (this run: 24)" in message and "temperature 0.0 (this run: 0.9)" in message
    with pytest.raises(batch.OutputError, match=r"bank b1 \(this run: b2\)"):
        from types import SimpleNamespace

        batch.check_output(out, False, settings=batch.run_settings(GenerateParams(max_new_tokens=8), "bfloat16",
                                                                    SimpleNamespace(digest="b2")))
    with pytest.raises(batch.OutputError, match=r"dtype bfloat16 \(this run: float32\)"):
        batch.check_output(out, False, settings={**made, "dtype": "float32"})
    assert _settings(max_new_tokens=8, seed=5, top_p=0.5) == made  # greedy decoding ignores sampling's settings
    assert batch.check_output(out, True, settings=_settings(max_new_tokens=24)) == {}  # --overwrite: start over
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = pa.Table.from_pylist([{k: v for k, v in _row("a", "p", made).items() if k not in batch.RESUME_KEY}])
    pq.write_table(old, out)  # an output of an earlier version: no record of its settings
    with pytest.raises(batch.OutputError, match="earlier knnssd.*--overwrite"):
        batch.check_output(out, False, settings=made)


def test_a_complete_output_is_known_before_any_work(tmp_path):
    """Rerunning a finished `generate` loaded the model and started a flow to generate nothing: the
    output's rows are checked first. A prompt missing or changed under its id, or a killed run's journal
    still to be folded into the output, leaves work to do."""
    from knnssd.prompts import Prompt

    out = tmp_path / "o.parquet"
    made = _settings(max_new_tokens=8)
    rows = [Prompt("a", "pa"), Prompt("b", "pb")]
    assert batch.already_complete(out, rows, batch.check_output(out, False, made)) is None  # no output yet
    batch.write_parquet([_row("b", "pb", made), _row("a", "pa", made)], out)
    done = batch.check_output(out, False, made)
    summary = batch.already_complete(out, rows, done)
    assert summary.rows == 2 and summary.generated == 0 and summary.new_tokens == 4 and summary.output == str(out)
    assert batch.already_complete(out, [*rows, Prompt("c", "pc")], done) is None
    assert batch.already_complete(out, [Prompt("a", "pa"), Prompt("b", "changed")], done) is None
    batch.progress_path(out).write_text(json.dumps(_row("a", "pa", made)) + "\n")
    assert batch.already_complete(out, rows, batch.check_output(out, False, made)) is None


def test_an_output_that_is_the_input_is_refused_even_with_overwrite(tmp_path):
    """Defect 2: ``--input x.parquet --output x.parquet --overwrite`` replaced the prompts with the answers.
    The same path, a symbolic link and a hard link are all refused, as are the output's journal and lock."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    inp = tmp_path / "x.parquet"
    pq.write_table(pa.table({"prompt": ["hello"]}), inp)
    before = inp.read_bytes()
    (tmp_path / "link.parquet").symlink_to(inp)
    os.link(inp, tmp_path / "hard.parquet")
    for out in (inp, tmp_path / "." / "x.parquet", tmp_path / "link.parquet", tmp_path / "hard.parquet"):
        with pytest.raises(batch.OutputError, match="is the input file .*choose another path, such as"):
            output_paths.check_paths(out, [str(inp)])
    journal = tmp_path / "y.parquet.progress.jsonl"
    journal.write_text('{"prompt": "hi"}\n')
    with pytest.raises(batch.OutputError, match="is the input file"):
        output_paths.check_paths(tmp_path / "y.parquet", [journal])
    assert inp.read_bytes() == before
    output_paths.check_paths(tmp_path / "other.parquet", [inp])


def test_outputs_that_are_not_parquet_files_are_refused(tmp_path):
    """The trial after issue 40: ``--output /dev/null`` got "not a parquet file (FileNotFoundError) ... pass
    --overwrite", and ``--overwrite`` then replaced a device node; ``o.csv`` got parquet silently."""
    fifo = tmp_path / "pipe.parquet"
    os.mkfifo(fifo)
    for out, message in ((Path("/dev/null"), "is not a regular file"), (fifo, "is not a regular file"),
                         (tmp_path / "o.csv", "does not name a .parquet file"),
                         (tmp_path / "trail", "does not name a .parquet file")):
        with pytest.raises(batch.OutputError, match=message):
            output_paths.check_paths(out)
    link = tmp_path / "link.parquet"
    link.symlink_to(tmp_path / "real.parquet")
    assert output_paths.output_path(link) == tmp_path / "real.parquet"  # written through the link, not over it
    output_paths.check_paths(tmp_path / "o.pq")


def test_torn_edited_or_foreign_journal_lines_are_skipped_with_a_warning(tmp_path, caplog):
    """Defect 12: a hand-edited ``.progress.jsonl`` with missing fields raised a ``TypeError`` on every rerun."""
    out = tmp_path / "o.parquet"
    made = _settings()
    good = _row("a", "pa", made)
    broken = {k: v for k, v in _row("b", "pb", made).items() if k not in ("latency_s", "steps")}
    lines = [json.dumps(good), json.dumps(broken), json.dumps([1, 2]), json.dumps({**good, "id": 7}),
             json.dumps({**_row("c", "pc", made), "new_tokens": True}), '{"id": "d", "te',
             json.dumps({**_row("e", "pe", made), "settings": "{not json"}),
             json.dumps({**_row("f", "pf", made), "new_tokens": -1}), json.dumps({**_row("g", "pg", made), "tokens": [1]}),
             json.dumps({**_row("h", "ph", made), "similarity": math.nan}),
             json.dumps({**_row("i", "pi", made), "similarity": -0.25})]  # a cosine may be negative: kept
    batch.progress_path(out).write_text("\n".join(lines))
    with caplog.at_level("WARNING"):
        done = batch.check_output(out, False, settings=made)
    assert list(done) == ["a", "i"]
    assert "9 row(s) are not knnssd rows" in caplog.text
    assert batch.summarize(list(done.values()), 0, out, None).rows == 2


def test_drafter_arguments_are_checked():
    """Defect 13: ``--max-draft -1`` silently turned drafting off; a NaN threshold was taken."""
    from knnssd.engine.spec.drafters import DrafterConfig

    for bad, message in ((dict(max_len=-1), "max_len must be an integer >= 1"), (dict(max_len=0), ">= 1"),
                         (dict(threshold=math.nan), r"threshold must be a probability in \[0, 1\], got nan"),
                         (dict(threshold=1.5), "got 1.5"), (dict(threshold=-0.1), "got -0.1"),
                         (dict(ngram_max_len=0), "ngram_max_len"), (dict(ngram_sizes=[]), "ngram_sizes"),
                         (dict(kind="tree"), "unknown drafter kind")):
        with pytest.raises(ValueError, match=message):
            DrafterConfig(**{"kind": "hybrid", **bad})
    DrafterConfig(kind="hybrid", max_len=1, threshold=1.0)


def test_limits_are_the_model_context_and_the_kv_budget():
    """Defects 5 and 7: a billion new tokens tried to allocate 384 GB after the model loaded, and a 44k-token
    prompt ran for minutes on a model of 8,192 positions."""
    from knnssd.engine.spec.request_params import Limits

    lim = Limits(context=8192, kv_bytes=23040)
    assert lim.positions == 8192
    with pytest.raises(ValueError, match=r"max_new_tokens \(1000000000\) must be below the model's context of 8192"):
        lim.check(GenerateParams(max_new_tokens=10**9))
    assert lim.prompt_tokens(GenerateParams(max_new_tokens=8, max_prompt_tokens=100_000)) == 8184
    assert lim.prompt_tokens(GenerateParams(max_new_tokens=8, max_prompt_tokens=100)) == 100
    big = Limits(context=1 << 20, kv_bytes=1 << 20, memory=1 << 30)  # 1 MiB a position: 1,024 fit the budget
    with pytest.raises(ValueError, match=r"below the 1 GiB KV-cache budget of one sequence \(1024 positions\)"):
        big.check(GenerateParams(max_new_tokens=1024))


def test_server_settings_are_checked_in_one_line_each():
    """Defects 6, 10 and 13: ``KNNSSD_BATCH_SIZE=abc``, ``KNNSSD_DTYPE=float16`` and ``KNNSSD_DEVICE=cuda``
    gave tracebacks of 100-147 lines, and ``KNNSSD_BATCH_SIZE=0`` (which the CLI rejects) was taken."""
    import torch

    from knnssd.serving.pyfunc import server_settings

    cases = [({"KNNSSD_BATCH_SIZE": "abc"}, "KNNSSD_BATCH_SIZE must be 'auto' or an integer >= 1, got 'abc'"),
             ({"KNNSSD_BATCH_SIZE": "0"}, "got '0'"), ({"KNNSSD_BATCH_SIZE": "-3"}, "got '-3'"),
             ({"KNNSSD_DTYPE": "float16"}, "KNNSSD_DTYPE='float16' is not one of auto, bfloat16, float32"),
             ({"KNNSSD_DEVICE": "gpu0"}, "KNNSSD_DEVICE: unknown device 'gpu0'"),
             ({"KNNSSD_GRAPHS": "1"}, "KNNSSD_GRAPHS='1' is not one of auto, on, off")]
    if not torch.cuda.is_available():
        cases.append(({"KNNSSD_DEVICE": "cuda"}, "KNNSSD_DEVICE: device 'cuda' asked for, but CUDA is not available"))
    for env, message in cases:
        with pytest.raises(ValueError) as e:
            server_settings(env)
        assert message in str(e.value) and "\n" not in str(e.value), env
    assert server_settings({"KNNSSD_DTYPE": "", "KNNSSD_BATCH_SIZE": " 4 "}) == {
        "model": None, "dtype": "auto", "device": "auto", "slots": 4}


def test_the_scoring_servers_variable_is_where_mlflow_sets_it():
    """``pyfunc._refuse`` knows it runs under ``mlflow models serve`` by the variable MLflow's scoring server
    sets (a private name): this fails loudly when the pinned MLflow renames it."""
    from mlflow.pyfunc import scoring_server

    assert scoring_server._SERVER_MODEL_PATH == "__pyfunc_model_path__"


def test_server_answers_are_strict_json():
    """Defect 3: a request mixing a prompt no anchor matches with one that matches got ``"cluster": NaN``
    and clusters as floats (``3.0``), which JSON.parse rejects."""
    import io

    import numpy as np
    from mlflow.pyfunc.scoring_server import predictions_to_json

    from knnssd.engine.spec.loop import DecodeStats
    from knnssd.serving.pyfunc import frame
    from knnssd.serving.routed import Result

    def result(cluster, similarity):
        return Result("t", [1], cluster, "l", similarity, "plain AR", DecodeStats(), 0.0, 0.1, 3, False, np.zeros(2))

    out = io.StringIO()
    predictions_to_json(frame([result(None, 0.1), result(3, 0.9), result(None, math.nan)]), out)

    def strict(token):
        raise ValueError(f"not JSON: {token}")

    rows = json.loads(out.getvalue(), parse_constant=strict)["predictions"]
    assert [r["cluster"] for r in rows] == [None, 3, None] and isinstance(rows[1]["cluster"], int)
    assert rows[2]["similarity"] is None


@contextlib.contextmanager
def read_only_folder(path):
    """A folder no write into succeeds, root's included: a read-only tmpfs where this process may mount
    one, else one without write permission."""
    path.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                                                   capture_output=True).returncode == 0
    if not mounted:
        path.chmod(0o555)
    try:
        yield path
    finally:
        if mounted:
            subprocess.run(["umount", str(path)], check=True)
        else:
            path.chmod(0o755)


def _one_line_each(cases, env, seconds=30):
    """``cases``: (argv, message); each ends with exit status 2 and one line holding its message."""
    for (args, message), res in zip(cases, run_cli([args for args, _ in cases], env)):
        assert res.code == 2 and len(res.stderr) == 1 and message in res.stderr[0], (args, res)
        assert res.seconds < seconds, args


def _cli_env(tmp_path) -> dict:
    return {**os.environ, "KNNSSD_WORK": str(tmp_path / "work"), "PREFECT_HOME": str(tmp_path / "prefect")}


def test_cli_refuses_outputs_that_cannot_be_written_safely(tmp_path):
    """Defects 2 and 11 through the command line: an output that is the input (``--overwrite`` or not)
    and a name too long for the file system are one line, before anything loads, and the input stays. Trial 6,
    D4: an output in a folder that does not exist made the folder, then loaded the model and ran."""
    inp = tmp_path / "x.jsonl"
    inp.write_text('{"prompt": "Hello"}\n')
    before = inp.read_bytes()
    gen = ["generate", "--model-uri", str(tmp_path), "--input", str(inp)]
    _one_line_each([(gen + ["--output", str(inp), "--overwrite"], "is the input file"),
                    (gen + ["--output", str(tmp_path / ("n" * 300 + ".parquet"))], "output file name is too long"),
                    (gen + ["--output", str(tmp_path / "nosuch" / "o.parquet")],
                     f"the folder {tmp_path / 'nosuch'} does not exist; make it first")],
                   _cli_env(tmp_path))
    assert inp.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefect", "work", "x.jsonl"]


def test_cli_refuses_tracking_uris_that_cannot_work(tmp_path):
    """Defects 11 and 14 through the command line, before any server starts: no folder is created."""
    inp = tmp_path / "x.jsonl"
    inp.write_text('{"prompt": "Hello"}\n')
    gen = ["generate", "--model-uri", str(tmp_path), "--input", str(inp), "--output", str(tmp_path / "o.parquet")]
    _one_line_each([(gen + ["--tracking-uri", "ftp://example.org/x"], "MLflow does not take 'ftp:'"),
                    (gen + ["--tracking-uri", "sqlite:////path/that/does/not/exist/m.db"], "does not exist")],
                   _cli_env(tmp_path))
    assert not Path("/path").exists() and not (tmp_path / "o.parquet").exists()


def test_cli_refuses_drafter_and_search_values_that_cannot_work(tmp_path):
    """Defect 13 (drafting silently turned off, a NaN threshold taken) and the search budget's values:
    one line each, before the model loads or a server starts."""
    inp = tmp_path / "x.jsonl"
    inp.write_text('{"prompt": "Hello"}\n')
    _one_line_each([
        (["complete", "--prompt", "hi", "--drafter", "ngram", "--max-draft", "-1"], "max_len must be an integer >= 1"),
        (["complete", "--prompt", "hi", "--drafter", "hybrid", "--threshold", "nan"], "threshold must be a probability"),
        (["calibrate", "--trials", "-5"], "--trials must be an integer >= 1, got -5"),
        (["calibrate", "--minutes", "nan"], "--minutes must be a number of minutes > 0, got nan"),
        (["calibrate", "--k-per-domain", "0"], "k_per_domain: Input should be greater than or equal to 1 (got 0)"),
        (["add-domain", "--name", "x", "--input", str(inp), "--candidates", "0"], "--candidates must be an integer >= 1"),
        (["add-domain", "--name", "", "--input", str(inp)], "name: String should have at least 1 character"),
        (["add-domain", "--name", "x", "--input", str(inp), "--storage", "ftp://x/y"], "--storage ftp://x/y cannot be"),
        (["calibrate", "--storage", f"sqlite:///{tmp_path / 'no' / 'o.db'}"], "does not exist"),
        (["calibrate", "--storage", str(tmp_path / "no" / "j.log")], "the folder"),  # trial 4, D3: folders were made
        (["calibrate", "--layer", "-99"], "pooling layer must be -1"),
        (["complete", "--prompt", "hi", "--mask", str(tmp_path)], "cannot read it (Is a directory)"),
        (["complete", "--prompt", "hi", "--device", "cpu:99"], "unknown device 'cpu:99'"),
        (["calibrate", "--seed", "-5"], "--seed must be an integer in [0, 2**32), got -5"),
        (["calibrate", "--clusters", "5"], "--clusters sets an --unlabelled pool's clusters"),
        (["calibrate", "--alias", ""], "alias '' is not one MLflow takes"),
        (["calibrate", "--alias", "v1"], "alias 'v1' is reserved by MLflow"),
    ], _cli_env(tmp_path))
    assert not (tmp_path / "no").exists()


def test_add_domain_refuses_a_name_past_100_characters_before_anything_loads(tmp_path):
    """Trial 6: a 3,000-character ``--name`` was taken, and its search began before anything checked it."""
    inp = tmp_path / "x.jsonl"
    inp.write_text('{"prompt": "Hello"}\n')
    _one_line_each([(["add-domain", "--name", "n" * 3000, "--input", str(inp)],
                     "domain name of 3000 characters: at most 100")], _cli_env(tmp_path), seconds=5)


def test_search_worker_on_a_new_storage_says_so_before_the_model_loads(tmp_path):
    """Trial 6: ``search-worker --storage out/nosuch.journal`` printed nothing for over 150 s (the model's
    load and probe, the prompts' embedding); a user took it for hung. Its first line now comes before any
    of that, and names the storage as new. Stopped there, no journal is made."""
    journal = tmp_path / "nosuch.journal"
    proc = subprocess.Popen([sys.executable, "-m", "knnssd.cli", "search-worker", "--storage", str(journal),
                             "--worker-trials", "1"], stderr=subprocess.PIPE, text=True, env=_cli_env(tmp_path),
                            start_new_session=True)
    try:
        first = proc.stderr.readline()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert first.startswith("knnssd search-worker: 1 stage-1 trial(s) for each cluster, into "), first
    assert f"{journal} is new: the studies are made there" in first, first
    assert not journal.exists()


def test_usage_errors_and_unusable_prompt_files_are_one_line(tmp_path):
    """Trial 4, D1: argparse's usage errors printed 4-12 lines; D2: calibrate took a file with no calib
    rows only to refuse it after the Prefect server started."""
    evals = tmp_path / "e.jsonl"
    evals.write_text('{"prompt": "a", "split": "eval"}\n{"prompt": "b", "split": "eval"}\n')
    _one_line_each([
        ([], "required: COMMAND (see: knnssd --help)"),
        (["nosuch"], "invalid choice: 'nosuch'"),
        (["generate", "--max-new-tokens", "x"], "invalid int value: 'x' (see: knnssd generate --help)"),
        (["calibrate", "--bogus", "1"], "unrecognized arguments: --bogus 1 (see: knnssd calibrate --help)"),
        (["calibrate", "--input", str(evals)], "no rows with split 'calib'"),
        (["add-domain", "--name", "x", "--input", str(evals)], "no rows to calibrate 'x' on"),
    ], _cli_env(tmp_path), seconds=15)


def test_commands_that_read_a_version_leave_no_new_tracking_database(tmp_path):
    """Trial 4: a generate on a mistyped (new) sqlite file failed on the missing version only after
    MLflow had made a 954 kB database there, which stayed."""
    inp = tmp_path / "x.jsonl"
    inp.write_text('{"prompt": "Hello"}\n')
    (tmp_path / "drop").mkdir()
    store = ["--tracking-uri", f"sqlite:///{tmp_path / 'new.db'}"]
    _one_line_each([
        (["generate", "--model-uri", "models:/knnssd-smollm2@champion", "--input", str(inp), "--output",
          str(tmp_path / "o.parquet"), *store], "new.db does not exist, so nothing is registered there"),
        (["promote", "--input", str(inp), *store], "does not exist, so nothing is registered there"),
        (["add-domain", "--name", "x", "--input", str(inp), *store], "does not exist, so nothing is registered there"),
        (["watch", "--drop", str(tmp_path / "drop"), *store], "does not exist, so nothing is registered there"),
    ], _cli_env(tmp_path))
    assert not (tmp_path / "new.db").exists() and not (tmp_path / "o.parquet").exists()


def test_cli_refuses_a_work_folder_that_cannot_be_used(tmp_path):
    """Defect 11: ``KNNSSD_WORK`` naming a file or a read-only folder gave a traceback."""
    work_file = tmp_path / "work-file"
    work_file.write_text("")
    with read_only_folder(tmp_path / "ro") as ro:
        for work, message in ((work_file, "is a file, not a folder"), (ro, "cannot be written")):
            _one_line_each([(["complete", "--prompt", "hi"], message)], {**_cli_env(tmp_path), "KNNSSD_WORK": str(work)})


def test_cli_refuses_an_empty_cache_folder_that_cannot_be_written_in_one_line(tmp_path):
    """Trial 6, D7: a read-only ``KNNSSD_CACHE`` gave a warning (the kernels could not be built), then an error
    that spoke of making room. An empty one that cannot be made or written is one line naming the variable; a
    cache made beforehand may be read-only."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with read_only_folder(tmp_path / "ro") as ro:
        for cache in (blocker / "cache", ro):
            _one_line_each([(["complete", "--prompt", "hi"], f"cache folder {cache} cannot be written")],
                           {**_cli_env(tmp_path), "KNNSSD_CACHE": str(cache)})


def test_empty_settings_variables_mean_their_defaults(monkeypatch, tmp_path):
    """The trial after issue 40: ``KNNSSD_WORK=`` made the current folder the work folder."""
    from knnssd import settings

    monkeypatch.chdir(tmp_path)
    for name in ("KNNSSD_WORK", "KNNSSD_CACHE"):
        monkeypatch.setenv(name, "")
    assert settings.work_dir() == tmp_path / "artifacts" and settings.cache_dir() == Path.home() / ".cache" / "knnssd"


def test_metric_names_of_long_labels_stay_within_mlflows_limit():
    """The trial after issue 40: a 300-character domain name failed at registration, after its search."""
    long = tracking.metric_tag("n" * 300)
    assert len(long) == 64 and long != tracking.metric_tag("n" * 299) and tracking.metric_tag("reasoning") == "reasoning"


@pytest.mark.parametrize("alias", ["champion", "candidate", "a-b_c", "x" * 255, "", "has space", "champion@x", "v1", "V23",
                                   "latest", "LATEST", "x" * 256, "ü"])
def test_aliases_follow_mlflows_rules(alias):
    """``tracking.check_alias`` restates MLflow's alias rules so a bad ``--alias`` fails before the search; this
    fails loudly where the pinned MLflow's own validators (private names) say otherwise."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_alias_name, _validate_model_alias_name_reserved

    try:
        _validate_model_alias_name(alias)
        _validate_model_alias_name_reserved(alias)
        mlflow_takes = True
    except MlflowException:
        mlflow_takes = False
    try:
        tracking.check_alias(alias)
        ours = True
    except tracking.RegistryError:
        ours = False
    assert ours == mlflow_takes, alias


def test_storages_that_are_not_studies_are_refused_untouched(tmp_path):
    """Trial 3, D1-D3: a prompt file or a note given as ``--storage`` had an Optuna line appended (or a
    traceback after the model load); a sqlite file that is not a database gave a 168-line traceback."""
    from knnssd.search.study import check_storage

    for text in ('{"id": "a", "prompt": "x"}\n', "precious line\n"):
        note = tmp_path / "note.txt"
        note.write_text(text)
        with pytest.raises(ValueError, match="is not an Optuna journal"):
            check_storage(str(note))
        assert note.read_text() == text
    garbage = tmp_path / "bad.db"
    garbage.write_text("garbage\n" * 100)
    with pytest.raises(ValueError, match="cannot be opened"):
        check_storage(f"sqlite:///{garbage}")
    journal = tmp_path / "j.log"
    journal.write_text('{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}\n')
    check_storage(str(journal))  # a journal, a new file and a new sqlite file pass
    check_storage(str(tmp_path / "new.log"))
    check_storage(f"sqlite:///{tmp_path / 'new.db'}")


def test_ui_checks_its_port_and_store_before_starting(tmp_path):
    """Trial 3, D4 and D6: a port out of range gave a traceback and exit 0; a mistyped sqlite folder was made."""
    missing = tmp_path / "no" / "x.db"
    cases = run_cli([["ui", "--port", "99999"], ["ui", "--tracking-uri", f"sqlite:///{missing}"]],
                    env={**os.environ, "KNNSSD_WORK": str(tmp_path / "work")})
    assert [c.code for c in cases] == [2, 2] and all(len(c.stderr) == 1 for c in cases), cases
    assert "--port" in cases[0].stderr[0] and "does not exist" in cases[1].stderr[0]
    assert not missing.parent.exists()


def test_counts_sizes_and_json_options_are_checked_by_name(tmp_path):
    """Trial 3, D12, D13, D16, D18, D22: ``--prompts 0`` or ``-3`` ran every prompt (or a slice from the end)
    for minutes; ``--max-new-tokens 0`` failed in transformers after the load; a bad ``--sizes`` or ``--search``
    gave Python's message without the option's name; ``--worker-trials 0`` named calibrate's ``--trials``;
    bench-engine's ``--repeats 0`` raised an IndexError after the model loaded."""
    bank = ["--bank", str(tmp_path)]
    cases = run_cli([["bench-engine", "--prompts", "0"], ["bench-engine", "--prompts", "-3"],
                     ["bench-engine", "--max-new-tokens", "0"], ["bench-engine", "--repeats", "0"],
                     ["route-eval", "--model-uri", "x", "--prompts", "-1"],
                     ["search-worker", "--worker-trials", "0"],
                     ["bench-throughput", *bank, "--sizes", "0,abc"], ["watch", "--drop", str(tmp_path), "--search", "not json"],
                     ["watch", "--drop", str(tmp_path), "--promote", "[1]"]],
                    env={**os.environ, "KNNSSD_WORK": str(tmp_path / "work")})
    assert all(c.code == 2 for c in cases), cases
    for c, option in zip(cases, ["--prompts", "--prompts", "--max-new-tokens", "--repeats", "--prompts", "--worker-trials",
                                 "--sizes", "--search", "--promote"]):
        assert option in c.stderr[-1] and c.seconds < 30, (option, c)


def test_more_bad_values_fail_in_seconds_before_any_server(tmp_path):
    """Trial 3, D5, D9-D11, D14, D17, D19-D21: each failed only after a server started or the model loaded
    (or not at all: a UI on an address it cannot take exited 0, an unknown --search key was ignored, an
    unknown --cluster printed [], ``sqlite:///:memory:`` left a file named ``:memory:``)."""
    (tmp_path / "drop").mkdir()
    (tmp_path / "drop2").mkdir()
    (tmp_path / "drop2" / ".knnssd-processed.json").write_text("[1, 2]")
    mask = tmp_path / "mask.json"
    mask.write_text(json.dumps({"n_layers": 3, "skip_attn": [1], "skip_mlp": []}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "hi", "domain": "code", "split": s}) + "\n" for s in ("calib", "eval")))
    (tmp_path / "file").write_text("")
    store = ["--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    watch = ["watch", "--drop", str(tmp_path / "drop")]
    cases = {
        "--host 999.1.1.1 --port 5999: cannot serve there": ["ui", "--host", "999.1.1.1", "--port", "5999"],
        "is empty": [*watch, "--tracking-uri", ""],
        "is a file store": [*watch, "--tracking-uri", f"file://{tmp_path}/mlruns"],
        "in-memory database": [*watch, "--tracking-uri", "sqlite:///:memory:"],
        "search: add-domain setting(s) proxy_trial: unknown": [*watch, "--search", '{"proxy_trial": 3}'],
        "promote: promote setting(s) candidate: set by watch": [*watch, "--promote", '{"candidate": "3"}'],
        # trial 4, D8-D9: a corrupt state was found after the Prefect server started; a file was "not found"
        "watch state is corrupt (not an object of records)": [*watch[:2], str(tmp_path / "drop2")],
        "is a file: give the folder": ["watch", "--drop", str(tmp_path / "file")],
        "--trials must be an integer >= 1, got 0": ["demo", "--trials", "0"],
        "skip mask is for 3 layers; the model has 30": ["complete", "--prompt", "hi", "--mask", str(mask)],
        "--mask is for the layer_skip and hybrid drafters": [  # trial 6: the mask was ignored unsaid
            "complete", "--prompt", "hi", "--drafter", "ngram", "--mask", str(mask)],
        "--cluster nosuch: no such cluster here; the clusters are code": [
            "search-worker", "--input", str(prompts), "--cluster", "nosuch", "--storage", str(tmp_path / "j.log"),
            *store],
        "no alias 'nosuch' of registered model 'knnssd-smollm2'": [
            "promote", "--candidate", "nosuch", "--input", str(prompts), *store],
        f"{tmp_path / 'file'} is a file, not a folder": [
            "generate", "--model-uri", "models:/x@y", "--input", str(prompts), "--output", str(tmp_path / "file" / "o.parquet")],
    }
    results = run_cli(list(cases.values()), env={**os.environ, "KNNSSD_WORK": str(tmp_path / "work")}, cwd=tmp_path)
    for (want, argv), c in zip(cases.items(), results):
        assert c.code == 2 and len(c.stderr) == 1 and want in c.stderr[0] and c.seconds < 30, (argv, c)
    assert not (tmp_path / ":memory:").exists()


def test_a_server_on_an_ipv6_host_prints_a_url_that_opens():
    """Trial 7: `serve --host ::1` printed http://::1:8000/v1, which no client parses."""
    from knnssd.cli.options import url as _url

    assert _url("::1", 8000) == "http://[::1]:8000" and _url("127.0.0.1", 80) == "http://127.0.0.1:80"
