"""A prompt file cut into shards (``serving/shards.py``): a stable rule over ids, parts beside the output,
and one final file joined from them in input order, or an error that names the shard that lacks a row."""
import pytest

from knnssd.prompts import Prompt
from knnssd.serving import resume, shards
from knnssd.serving.output_paths import OutputError
from knnssd.serving.request import GenerateRequest


def _rows(n: int) -> list[Prompt]:
    return [Prompt(f"id-{i}", f"prompt {i}") for i in range(n)]


def _row(p: Prompt) -> dict:
    return {"id": p.id, "domain": None, "text": "x", "tokens": [1], "new_tokens": 1, "cluster": None, "label": "plain AR",
            "similarity": 0.1, "matched": False, "drafter": "plain AR", "acceptance_rate": 0.0, "mean_accepted": 1.0,
            "steps": 1, "drafted": 0, "accepted": 0, "latency_s": 0.1, "route_ms": 0.2, "tokens_per_s": 10.0,
            "prompt_tokens": 2, "truncated": False, "stop": "length", "prompt_hash": resume.prompt_hash(p.prompt),
            "settings": "{}"}


def test_the_rule_is_stable_and_keeps_input_order():
    rows = _rows(120)
    cut = [shards.rows_of(rows, i, 4) for i in range(4)]
    assert sorted(r.id for part in cut for r in part) == sorted(r.id for r in rows)  # every row once
    assert all(part == [r for r in rows if r in part] for part in cut)  # in input order
    assert shards.rows_of(list(reversed(rows)), 2, 4) == list(reversed(cut[2]))  # a row's shard: its id alone
    assert [shards.shard_of(f"id-{i}", 4) for i in range(6)] == [3, 2, 3, 0, 1, 3]  # on every machine, every run
    assert min(len(part) for part in cut) >= 20


def test_bad_shard_counts_are_one_line():
    for n in (0, -1, 5000, True, 2.5):
        with pytest.raises(ValueError, match="--shards must be an integer from 1 to 1024"):
            shards.check_count(n)
    with pytest.raises(ValueError, match="--shards 5 is more than the input's 3 prompts; use at most 3"):
        shards.check_shards(5, _rows(3))
    with pytest.raises(ValueError, match="--shards must be"):
        GenerateRequest("models:/m@a", "in.jsonl", "out.parquet", shards=0)
    with pytest.raises(ValueError, match="shard 4 is not one of the 4 shards"):
        GenerateRequest("models:/m@a", "in.jsonl", "out.parquet", shards=4, shard=4)
    assert GenerateRequest("m", "i", "o.parquet", shards=4).sharded
    assert not GenerateRequest("m", "i", "o.parquet", shards=4, shard=1).sharded


def test_the_parts_join_in_input_order_or_name_the_shard_that_lacks_a_row(tmp_path):
    rows, out = _rows(12), tmp_path / "o.parquet"
    shards.check_parts(out, 3, overwrite=False)
    for i in range(3):
        resume.write_parquet([_row(r) for r in reversed(shards.rows_of(rows, i, 3))], shards.part_path(out, i, 3))
    assert [r["id"] for r in shards.join(out, rows, 3)] == [r.id for r in rows]
    assert [r["id"] for r in resume.read_done(out).values()] == [r.id for r in rows]
    assert all(shards.complete(shards.rows_of(rows, i, 3), shards.part_path(out, i, 3)) for i in range(3))
    out.unlink()
    missing = shards.rows_of(rows, 1, 3)[0]
    resume.write_parquet([_row(r) for r in shards.rows_of(rows, 1, 3)[1:]], shards.part_path(out, 1, 3))
    with pytest.raises(OutputError, match=f"shard 1 of 3 has no answer for prompt '{missing.id}'"):
        shards.join(out, rows, 3)
    assert not out.exists() and len(list(shards.parts_folder(out).iterdir())) == 3  # kept for the rerun
    assert shards.finished(shards.part_path(out, 1, 3)) == len(shards.rows_of(rows, 1, 3)) - 1
    shards.remove_parts(out, 3)
    assert not shards.parts_folder(out).exists()


def test_parts_of_another_cut_or_an_unwritable_folder_are_refused(tmp_path):
    out = tmp_path / "o.parquet"
    shards.check_parts(out, 2, overwrite=False)
    resume.write_parquet([_row(Prompt("a", "p"))], shards.part_path(out, 0, 2))
    with pytest.raises(OutputError, match=r"holds the parts of a run cut into 2 shards; run it again with --shards 2"):
        shards.check_parts(out, 3, overwrite=False)
    shards.check_parts(out, 3, overwrite=True)  # --overwrite: the other cut's parts go
    assert list(shards.parts_folder(out).iterdir()) == []
    blocked = tmp_path / "blocked.parquet"
    shards.parts_folder(blocked).write_text("a file where the parts' folder goes")
    with pytest.raises(OutputError, match=r"cannot write the shards' parts in .*blocked.parquet.parts \(File exists\)"):
        shards.check_parts(blocked, 2, overwrite=False)
