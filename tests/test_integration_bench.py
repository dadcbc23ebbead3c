"""A reduced `knnssd bench` through its flow: output files, MLflow run, fp32 agreement 1.0, its throughput
table, resume."""
import json
import os

import pytest

from knnssd.bench import bank as bench
from knnssd.engine.spec.drafters import DrafterConfig
from knnssd.engine.model.skip import SkipMask
from test_integration_calibrate import fixed_bank

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def banks(tmp_path_factory, data_dir):
    """Three banks with fixed configurations (no search): routed drafters (one with a mask), masks only, static."""
    tmp = tmp_path_factory.mktemp("bench")
    os.environ["KNNSSD_WORK"] = str(tmp / "work")
    skip = SkipMask.from_layers(30, attn=[20, 24], mlp=[26]).to_dict()
    routed = {"reasoning": DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(30, mlp=[27]).to_dict(), max_len=6,
                                         threshold=0.5, int8=True, adaptive=True),
              "translation": DrafterConfig(kind="ngram", max_len=8, adaptive=True)}
    masks = DrafterConfig(kind="layer_skip", mask=skip, max_len=4, threshold=0.6)
    out = {"bank": str(fixed_bank(tmp, data_dir, "routed", lambda c: routed[c.label])),
           "masks_bank": str(fixed_bank(tmp, data_dir, "masks", lambda c: masks)),
           "static_bank": str(fixed_bank(tmp, data_dir, "static", lambda c: routed["reasoning"], labelled=False))}
    yield out, tmp
    os.environ.pop("KNNSSD_WORK", None)


def test_reduced_bench_through_flow(banks, data_dir, prefect_harness, tmp_path):
    from knnssd.flows.bench import bench as bench_flow

    paths, tmp = banks
    cfg = bench.BenchConfig(**paths, dtype="float32", data=data_dir, domains=("reasoning", "translation"),
                            ood=("ood_math",), prompts=1, ood_prompts=1, max_new_tokens=8, repeats=2,
                            ratios=(0.0, 1.0), out=tmp_path / "results", tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}",
                            throughput=3, throughput_sizes=(2,))
    summary = bench_flow(cfg)
    out = tmp_path / "results"
    for name in ("bench.json", "bench.md", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0, name
    rep = json.loads((out / "bench.json").read_text())
    assert rep["settings"]["methods"] == list(bench.METHODS)
    for m in bench.METHODS:
        assert rep["mixed"][m]["agreement_with_ar"] == 1.0, m  # fp32: every method is exact
        assert rep["mixed"][m]["prompts"] == 2
    assert set(rep["streams"]) == {"0.0", "1.0"} and rep["routing_accuracy"] == 1.0
    assert rep["ood"]["ood_math"]["knn_routed"]["agreement_with_ar"] == 1.0
    assert 0 <= rep["targets"]["routing_overhead_pct"] < 5
    assert summary["mlflow_run_id"] == rep["mlflow_run_id"]
    assert "| **mixed** |" in (out / "bench.md").read_text()
    assert rep["versus_best_fixed"]["mixed"]["best_fixed"] in ("ngram", "suffix")  # routed over the best fixed
    assert rep["targets"]["routed_over_best_fixed"] == rep["versus_best_fixed"]["mixed"]["routed_over_best_fixed"]
    assert "| set | best fixed | its speedup | routed | routed / best fixed |" in (out / "bench.md").read_text()
    tp = rep["throughput"]  # bench-throughput's table: every setting's tokens equal routed b=1's (fp32)
    assert [r["setting"] for r in tp["table"]] == ["routed b=1", "plain b=2", "routed b=2", "routed auto"]
    assert tp["prompts"] == 3 and all(r["same_as_b1"] == 1.0 and r["tokens_per_s"] > 0 for r in tp["table"])
    assert "| routed auto |" in (out / "bench.md").read_text()
    rows = rep["mask_ablation"]  # the masked reasoning clusters, with vs without their mask
    assert rows and all(r["label"] == "reasoning" and r["skipped"] == 1 for r in rows)
    assert sum(r["prompts"] for r in rows) == 1 and any(r["mask_gain"] is not None for r in rows)

    # a rerun with the same settings resumes the journal and the throughput table: nothing is measured again
    journal = next(out.glob("measurements-*.jsonl"))
    lines = journal.read_text().count("\n")
    assert bench.run(cfg)["throughput"] == tp
    assert journal.read_text().count("\n") == lines


def test_stream_order_keeps_every_prompt_and_switch_rate():
    from knnssd.prompts import Prompt

    rows = [Prompt(f"{d}{i}", "x", d) for d in "abcde" for i in range(20)]
    for r in (0.0, 0.3, 0.7, 1.0):
        order = bench.stream_order(rows, r, seed=1)
        assert sorted(p.id for p in order) == sorted(p.id for p in rows)
        switches = sum(a.domain != b.domain for a, b in zip(order, order[1:])) / (len(order) - 1)
        if r == 0.0:
            assert switches == 4 / 99  # one block per domain
        elif r == 1.0:
            assert switches > 0.9
        else:
            assert abs(switches - r) < 0.2


def test_the_llama_cpp_peer_decodes_the_same_gguf_with_and_without_lookup():
    """``bench-throughput``'s peer rows, where the ``peers`` extra is installed: llama.cpp on the embedded
    model's GGUF, fed knnssd's prompt ids, stops at the token count or an end id (counted), each prompt timed."""
    from knnssd import models
    from knnssd.bench import peers

    if not peers.available():
        pytest.skip("llama-cpp-python (the peers extra) is not installed")
    lm = models.load("smollm2", dtype="float32")
    ids = [lm.tokenizer("The capital of France is").input_ids, lm.tokenizer("Count: 1, 2, 3, 4,").input_ids]
    eos = models.eos_ids(lm)
    for lookup in (False, True):
        out = peers.generate(models.gguf_file("smollm2"), ids, 12, eos, 2, lookup)
        assert len(out) == 2
        for tokens, seconds in out:
            assert 1 <= len(tokens) <= 12 and seconds > 0
            assert len(tokens) == 12 or tokens[-1] in eos
            assert all(0 <= t < len(lm.tokenizer) for t in tokens)
