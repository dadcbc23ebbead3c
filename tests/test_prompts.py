"""Prompt files: formats, splits, and one-line errors for every bad input."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from knnssd import prompts
from knnssd.search import steps
def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_formats_fields_and_splits(tmp_path):
    rows = [{"id": "a", "prompt": "x", "domain": "d", "split": "calib"}, {"id": "b", "prompt": "y", "split": "eval"}]
    j = write_jsonl(tmp_path / "p.jsonl", rows)
    pq.write_table(pa.table({"q": ["x", "y"], "key": ["a", "b"]}), tmp_path / "p.parquet")
    (tmp_path / "p.csv").write_text("prompt,domain\nx,d\ny,e\n")
    assert [r.id for r in prompts.load(j, split="calib")] == ["a"]
    assert prompts.load(j, domain="fill")[1].domain == "fill"
    got = prompts.load(tmp_path / "p.parquet", fields=prompts.Fields(prompt="q", id="key"))
    assert [(r.id, r.prompt) for r in got] == [("a", "x"), ("b", "y")]
    assert [r.id for r in prompts.load(tmp_path / "p.csv")] == [prompts.auto_id("p", t, {}) for t in "xy"]


def test_a_file_without_splits_calibrates_on_its_first_two_thirds(tmp_path):
    """Trial 4, D2: calibrate refused such a file ("no rows with split 'calib'"), and only after Prefect
    started; add-domain took it. One rule now serves both, and the CLI checks it before any server."""
    j = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    calib, ev = prompts.load(j, split="calib"), prompts.load(j, split="eval")
    assert [r.prompt for r in calib] == ["p0", "p1", "p2", "p3"] and [r.prompt for r in ev] == ["p4", "p5"]
    assert [r.prompt for r in steps.load_prompts([str(j)], "calib")] == ["p0", "p1", "p2", "p3"]
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "only"}])
    with pytest.raises(prompts.PromptError, match="no split field: of its 1 rows the first two thirds calibrate"):
        prompts.load(one, split="eval")


def test_a_csv_with_an_unterminated_quote_is_refused(tmp_path):
    """Trial 5: ``a,"unterminated`` was read as one row whose prompt ran to the end of the file."""
    path = tmp_path / "p.csv"
    path.write_text('prompt\nfirst\n"unterminated\nsecond\n')
    with pytest.raises(prompts.PromptError, match="cannot read"):
        prompts.load(path)


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    """Trial 4: a .jsonl saved with a UTF-8 byte-order mark was refused ("line 1 is not JSON")."""
    for name in ("p.jsonl", "p.json"):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "prompt": "x"}\n')
        assert [(r.id, r.prompt) for r in prompts.load(tmp_path / name)] == [("a", "x")]


@pytest.mark.parametrize("content, message", [
    (b"", "no rows"),
    (b'{"text": "x"}\n', "has no 'prompt' field"),
    (b'{"prompt": 3}\n', "is not text"),
    (b'{"prompt": "caf\xe9"}\n', "not UTF-8"),
    (b'{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "duplicate id '1'"),
    (b'{"prompt": "a"\n', "line 1 is not JSON"),
    (b'[{"prompt": "a"}, {"prompt": "b"}]\n', "row 1 is not an object"),
    # ids that were kept as Python's text of them ("{'x': 1}", "True")
    (b'{"id": {"x": 1}, "prompt": "a"}\n', "row 1 field 'id' must be a string or a number, got an object"),
    (b'{"id": "a", "prompt": "a"}\n{"id": true, "prompt": "b"}\n', "row 2 field 'id' .* got a boolean"),
    (b'{"id": [1], "prompt": "a"}\n', "got an array"),
])
def test_bad_files_fail_in_one_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(prompts.PromptError, match=message) as e:
        prompts.load(path)
    assert "\n" not in str(e.value)


def test_missing_unknown_and_cross_file_duplicates(tmp_path):
    with pytest.raises(prompts.PromptError, match="not found"):
        prompts.load(tmp_path / "nope.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(prompts.PromptError, match="unknown format"):
        prompts.load(tmp_path / "x.txt")
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": "1", "prompt": "x", "split": "calib"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "1", "prompt": "y", "split": "calib"}])
    with pytest.raises(prompts.PromptError, match="duplicate id '1'"):
        steps.load_prompts([str(a), str(b)])
    with pytest.raises(prompts.PromptError, match="no rows with split 'calib'"):
        prompts.load(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "split": "eval"}]), split="calib")


def test_hf_dataset_names_fail_clearly_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(prompts.PromptError, match="^hf:owner/none@test: ") as e:
        prompts.load("hf:owner/none@test")
    assert "\n" not in str(e.value)


def test_what_is_not_a_prompt_file_says_so(tmp_path):
    """The trial after issue 40: a folder or ``/dev/null`` was "not found", a CSV naming ``prompt`` twice
    used one of them silently, and a ``.json`` file holding a list of rows was read as JSON lines."""
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(prompts.PromptError, match="is a folder, not a prompt file"):
        prompts.load(tmp_path / "folder.jsonl")
    with pytest.raises(prompts.PromptError, match="is not a regular file"):
        prompts.load("/dev/null")
    (tmp_path / "twice.csv").write_text("prompt,prompt\na,b\n")
    with pytest.raises(prompts.PromptError, match="column 'prompt' appears more than once"):
        prompts.load(tmp_path / "twice.csv")
    (tmp_path / "rows.json").write_text(json.dumps([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}], indent=1))
    assert [(r.id, r.prompt) for r in prompts.load(tmp_path / "rows.json")] == [("a", "x"), ("b", "y")]
    (tmp_path / "bom.csv").write_bytes("\ufeffprompt\nhello\n".encode())
    assert [r.prompt for r in prompts.load(tmp_path / "bom.csv")] == ["hello"]


def test_without_shared_data_the_default_files_are_the_bundled_samples(monkeypatch):
    """The bundled samples hold four of the five domains; a run given no --input takes those, not a missing
    summarization file."""
    from pathlib import Path

    from knnssd import prompts

    monkeypatch.setenv("KNNSSD_DATA", str(prompts.samples_dir()))
    files = prompts.domain_files()
    assert files and all(Path(f).is_file() for f in files)
    assert [Path(f).stem for f in files] == sorted(p.stem for p in prompts.samples_dir().glob("*.jsonl"))


def test_a_missing_id_read_as_nan_gets_its_own_id(tmp_path):
    """A csv's or parquet's missing id reads as NaN: it was kept as "nan", and two of them were duplicates."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": NaN, "prompt": "a"}\n{"id": NaN, "prompt": "b"}\n{"id": 7, "prompt": "c"}\n')
    ids = [r.id for r in prompts.load(path)]
    assert ids[2] == "7" and "nan" not in ids and len(set(ids)) == 3


def test_ids_of_rows_without_one_follow_the_prompt_not_its_position(tmp_path):
    """Defect 1: auto ids were positional (``<file>-00000``), so a prompt put in front of the others took
    the first id, and a resume paired it with the old first prompt's answer."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "b"}\n{"prompt": "c"}\n{"prompt": "b"}\n')
    before = {r.prompt + str(i): r.id for i, r in enumerate(prompts.load(path))}
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n{"prompt": "b"}\n')
    after = [r.id for r in prompts.load(path)]
    assert after[1:] == [before["b0"], before["c1"], before["b2"]]  # the same prompts keep their ids
    assert after[0] not in before.values() and len(set(after)) == 4 and after[3] == after[1] + "-2"
