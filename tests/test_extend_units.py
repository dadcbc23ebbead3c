"""Units of bank growth (no model): new clusters, warm starts, merged banks, the drop-folder record."""
import json
import re

import pytest

from knnssd.prompts import Prompt
from knnssd.routing import bank as banks
from knnssd.routing import router
from knnssd.search import extend
from knnssd.serving import watch
from test_router_bank import blobs, make_bank


def test_new_domain_clusters_merge_and_route(tmp_path):
    base, _ = make_bank(tmp_path, n_layers=4)
    x, _ = blobs(n_per=8, dim=8, centers=4, seed=0)
    new_x = x[-8:]  # the fourth blob: a domain the bank has not seen
    path = tmp_path / "v.parquet"
    router.save_vectors(path, [f"n{i}" for i in range(8)], ["new"] * 8, new_x)
    clusters = extend.new_clusters(base, path, "new", k_per_domain=2)
    assert [c.id for c in clusters] == [3] and clusters[0].members == [f"n{i}" for i in range(8)]
    with pytest.raises(banks.BankError, match="already in the bank"):
        extend.new_clusters(base, path, "d0")
    warm = extend.warm_start(base, clusters[0])
    assert warm and warm[0]["int8"] is True and warm[0]["m1"] is True and warm[0]["a0"] is False
    results = [banks.ClusterResult(3, {"kind": "ngram", "max_len": 6}, speedup=1.9, acceptance_rate=0.5, mean_accepted=2.0)]
    merged = extend.merged(base, clusters, results, "models:/x/1")
    assert [c.label for c in merged.clusters] == ["d0", "d1", "d2", "new"]
    assert len(merged.anchors) == len(base.anchors) + 2 and merged.extra["added"] == ["new"]
    r = merged.router()
    assert all(r.route(v).cluster == 3 for v in new_x)
    assert all(r.route(v).cluster in (0, 1, 2) for v in x[:24])


def test_split_rows():
    rows = [Prompt(str(i), "p") for i in range(9)]
    calib, ev = extend.split_rows(rows, "code")
    assert len(calib) == 6 and len(ev) == 3 and {r.domain for r in calib + ev} == {"code"}
    rows = [Prompt("a", "p", split="calib"), Prompt("b", "p", split="eval"), Prompt("c", "p", split="calib")]
    calib, ev = extend.split_rows(rows, "code")
    assert [r.id for r in calib] == ["a", "c"] and [r.id for r in ev] == ["b"]


def test_a_new_domain_name_is_not_taken_for_another(tmp_path):
    """Trial 4: "Code" beside "code", or "x/code", was added, and its promotion metric (``ratio_code``)
    then stood for two domains."""
    taken = ["code", "text_to_sql"]
    extend.check_name(taken, "sql")
    for name, message in (("code", "already in the bank;"), ("Code", "(as 'code'"), ("text-to-sql", "(as 'text_to_sql'"),
                          ("x/code", "cannot hold '/'"), ("a\tb", "control characters")):
        with pytest.raises(banks.BankError, match=re.escape(message)):
            extend.check_name(taken, name)


def test_drop_folder_record(tmp_path):
    drop, work = tmp_path / "drop", tmp_path / "work"
    drop.mkdir()
    (drop / "Code Set.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(5)))
    (drop / "tiny.jsonl").write_text(json.dumps({"prompt": "p"}) + "\n")
    (drop / "broken.jsonl").write_text("{not json\n")
    (drop / "notes.txt").write_text("ignored")
    state = drop / ".state.json"
    items = watch.pending(drop, state, "m", min_prompts=3, use_unmatched=False, work=work)
    assert [(i.name, i.rows) for i in items] == [("code-set", 5)]
    watch.mark(state, items, {"uri": "models:/k/7", "version": "7"})
    assert watch.pending(drop, state, "m", 3, False, work) == []  # processed once
    # added, not yet promoted: a watch stopped now promotes version 7 on its next run
    assert watch.unpromoted(state) == {"uri": "models:/k/7", "version": "7", "inputs": [items[0].path]}
    (drop / "Code Set.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(5)))
    assert len(watch.pending(drop, state, "m", 3, False, work)) == 1  # changed content is new again

    import pyarrow as pa
    import pyarrow.parquet as pq

    log = work / "unmatched" / "m"
    log.mkdir(parents=True)
    for k in range(2):
        pq.write_table(pa.table({"id": [f"u{k}{i}" for i in range(2)], "prompt": ["x"] * 2, "similarity": [0.1] * 2}),
                       log / f"unmatched-{k}.parquet")
    items = watch.pending(drop, state, "m", 3, True, work)
    un = [i for i in items if i.kind == "unmatched"]
    assert len(un) == 1 and un[0].rows == 4 and len(un[0].sources) == 2
    watch.mark(state, un, {"uri": "models:/k/8", "version": "8"})  # extends 7: both wait for one promotion
    assert watch.unpromoted(state) == {"uri": "models:/k/8", "version": "8", "inputs": [items[0].path, un[0].path]}
    assert [i.kind for i in watch.pending(drop, state, "m", 3, True, work)] == ["file"]
    watch.promoted(state)
    assert watch.unpromoted(state) is None
    state.write_text("{torn")
    with pytest.raises(ValueError, match="corrupt"):
        watch.pending(drop, state, "m", 3, True, work)


def test_promotion_keeps_each_banks_best_time_so_one_slowed_run_does_not_decide():
    """A neighbour on the machine slowed one of the candidate's runs 50-fold: with three runs a side
    the candidate's best time counts; one run alone would have refused it. Order alternates."""
    from types import SimpleNamespace

    from knnssd.serving.promote import best_times

    calls = []

    class Side:
        def __init__(self, name, times):
            self.name, self.times = name, iter(times)

        def generate(self, prompt, params):
            calls.append(self.name)
            return SimpleNamespace(latency_s=next(self.times), tokens=[1, 2] if prompt != "odd" else [self.name])

    rows = [Prompt("a", "p"), Prompt("b", "q")]
    gens = {"candidate": Side("candidate", [5.0, 0.2, 0.25, 0.3, 0.2, 0.2]), "champion": Side("champion", [0.3] * 6)}
    t, identical = best_times(gens, rows, None, repeats=3)
    assert t == {"candidate": {"a": 0.2, "b": 0.2}, "champion": {"a": 0.3, "b": 0.3}} and identical
    assert calls[:6] == ["candidate", "champion", "champion", "candidate", "candidate", "champion"]
    one, _ = best_times({"candidate": Side("candidate", [5.0, 0.2]), "champion": Side("champion", [0.3] * 2)}, rows,
                        None, repeats=1)
    assert sum(one["champion"].values()) / sum(one["candidate"].values()) < 0.2
    _, identical = best_times({k: Side(k, [0.1] * 3) for k in gens}, [Prompt("c", "odd")], None, repeats=3)
    assert not identical
