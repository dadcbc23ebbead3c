"""What an output holds (``serving/resume.py``): resume under the same settings only, a finished output
known before any work (``batch.already_complete``), and journal lines it cannot use skipped."""
import json
import math

import pytest

from knnssd.engine.spec.request_params import GenerateParams
from knnssd.serving import batch, resume


def _row(pid: str, prompt: str, settings: dict, **over) -> dict:
    """A finished output row as ``batch._run`` writes it."""
    row = {"id": pid, "domain": None, "text": "x", "tokens": [1, 2], "new_tokens": 2, "cluster": None, "label": "plain AR",
           "similarity": 0.1, "matched": False, "drafter": "plain AR", "acceptance_rate": 0.0, "mean_accepted": 1.0,
           "steps": 2, "drafted": 0, "accepted": 0, "latency_s": 0.1, "route_ms": 0.2, "tokens_per_s": 20.0,
           "prompt_tokens": 3, "truncated": False, "stop": "length", "prompt_hash": resume.prompt_hash(prompt),
           "settings": resume.settings_text(settings)}
    return {**row, **over}


def _settings(**params) -> dict:
    from types import SimpleNamespace

    return resume.run_settings(GenerateParams(**params), "bfloat16", SimpleNamespace(digest="b1"))


def test_resume_refuses_other_settings_and_names_them(tmp_path):
    """Defect 4: a rerun with other parameters reported ``"generated": 0`` and kept the old rows."""
    out = tmp_path / "o.parquet"
    made = _settings(max_new_tokens=8)
    resume.write_parquet([_row("a", "p", made)], out)
    assert set(resume.check_output(out, False, settings=made)) == {"a"}
    with pytest.raises(resume.OutputError) as e:
        resume.check_output(out, False, settings=_settings(max_new_tokens=24, temperature=0.9, seed=3))
    message = str(e.value)
    assert "\n" not in message and "--overwrite" in message
    assert "max_new_tokens 8 (this run: 24)" in message and "temperature 0.0 (this run: 0.9)" in message
    with pytest.raises(resume.OutputError, match=r"bank b1 \(this run: b2\)"):
        from types import SimpleNamespace

        resume.check_output(out, False, settings=resume.run_settings(GenerateParams(max_new_tokens=8), "bfloat16",
                                                                    SimpleNamespace(digest="b2")))
    with pytest.raises(resume.OutputError, match=r"dtype bfloat16 \(this run: float32\)"):
        resume.check_output(out, False, settings={**made, "dtype": "float32"})
    assert _settings(max_new_tokens=8, seed=5, top_p=0.5) == made  # greedy decoding ignores sampling's settings
    assert resume.check_output(out, True, settings=_settings(max_new_tokens=24)) == {}  # --overwrite: start over
    import pyarrow as pa
    import pyarrow.parquet as pq

    old = pa.Table.from_pylist([{k: v for k, v in _row("a", "p", made).items() if k not in resume.RESUME_KEY}])
    pq.write_table(old, out)  # an output of an earlier version: no record of its settings
    with pytest.raises(resume.OutputError, match="earlier knnssd.*--overwrite"):
        resume.check_output(out, False, settings=made)


def test_a_complete_output_is_known_before_any_work(tmp_path):
    """Rerunning a finished `generate` loaded the model and started a flow to generate nothing: the
    output's rows are checked first. A prompt missing or changed under its id, or a killed run's journal
    still to be folded into the output, leaves work to do."""
    from knnssd.prompts import Prompt

    out = tmp_path / "o.parquet"
    made = _settings(max_new_tokens=8)
    rows = [Prompt("a", "pa"), Prompt("b", "pb")]
    assert batch.already_complete(out, rows, resume.check_output(out, False, made)) is None  # no output yet
    resume.write_parquet([_row("b", "pb", made), _row("a", "pa", made)], out)
    done = resume.check_output(out, False, made)
    summary = batch.already_complete(out, rows, done)
    assert summary.rows == 2 and summary.generated == 0 and summary.new_tokens == 4 and summary.output == str(out)
    assert batch.already_complete(out, [*rows, Prompt("c", "pc")], done) is None
    assert batch.already_complete(out, [Prompt("a", "pa"), Prompt("b", "changed")], done) is None
    resume.progress_path(out).write_text(json.dumps(_row("a", "pa", made)) + "\n")
    assert batch.already_complete(out, rows, resume.check_output(out, False, made)) is None


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
    resume.progress_path(out).write_text("\n".join(lines))
    with caplog.at_level("WARNING"):
        done = resume.check_output(out, False, settings=made)
    assert list(done) == ["a", "i"]
    assert "9 row(s) are not knnssd rows" in caplog.text
    assert batch.summarize(list(done.values()), 0, out, None).rows == 2
