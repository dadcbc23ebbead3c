"""The command line (``knnssd/cli/``): bad values, paths, stores and folders refused in one line each,
before a model loads or a server starts, and signals left as the host set them. No model loads here."""
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from cli_cases import hold_output, run_cli


def test_a_second_generate_on_one_output_is_refused_before_any_bank_or_model_loads(tmp_path):
    """Trial 6: a second ``generate`` on an output being written took 39 s to be refused on a loaded machine.
    The lock is taken before the bank: here the bank URI names nothing, and the refusal names the holder."""
    inp, out = tmp_path / "x.jsonl", tmp_path / "out.parquet"
    inp.write_text('{"prompt": "Hello"}\n')
    holder = hold_output(out)
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
