"""``benchmarks/gpu_check.py``, the prepared GPU check, run as it is in its smoke mode on the CPU, and the
de-quantization of its packed weights (``knnssd.bench.packed_blocks``) against ``gguf``'s own."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_pack  # noqa: E402
from conftest import DATA  # noqa: E402

from knnssd.bench import packed_blocks  # noqa: E402


def test_the_gpu_check_runs_as_prepared_and_writes_its_report(tmp_path):
    report = gpu_check.main(["--smoke", "--device", "cpu", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["engine"]["rows"].keys() == report["engine"]["rows"].keys()
    text = (tmp_path / "gpu_check.md").read_text()
    for row in ("plain, eager engine", "plain, graphed", "n-gram, graphed", "layer-skip 50%, graphed", "HF generate"):
        assert f"| {row}" in text
    assert set(report["throughput"]) == {"1 eager", "1 graphed", "4 eager", "4 graphed"}
    assert report["big"]["step_over_floor"] > 0


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "F32"])
def test_packed_blocks_de_quantize_as_gguf_does(kind):
    w = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(raw, qtype)
    data = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(6, -1)
    got = packed_blocks.dequantize(dict(type=kind, shape=(6, 64), data=data))
    assert torch.equal(got, torch.from_numpy(want))


@pytest.mark.skipif(not DATA.exists(), reason="needs the prompt sets")
def test_the_packed_model_is_the_one_knnssd_loads(tmp_path):
    """The pack's weights, built as the check builds them, give the logits of ``models.load`` in bf16, bitwise: its
    rotary tables included (a model built empty and filled from a state dict had kept garbage in them)."""
    from knnssd import models

    gpu_pack.main(["--out", str(tmp_path / "gpu"), "--data", str(DATA), "--prompts", "5"])
    packed, tok = packed_blocks.load_packed(tmp_path / "gpu", torch.device("cpu"))
    lm = models.load("smollm2", "bfloat16", "cpu")
    ids = torch.tensor([tok("The capital of France is").input_ids])
    with torch.inference_mode():
        assert torch.equal(packed(ids).logits, lm.model(ids).logits)
    assert len((tmp_path / "gpu" / "a" / "prompts.jsonl").read_text().splitlines()) == 5
    assert not (tmp_path / "gpu.partial").exists()
