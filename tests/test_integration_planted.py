"""The mask search, proven where masks pay: SmolLM2 with 8 planted zero-output layers.

The inserted layers add nothing to the residual stream, so their 16 sub-layers are pure cost: a
calibration (Prefect flow, MLflow sqlite) must skip at least 80% of them in the chosen mask, the
bank's heatmap must be there and in the version's description (the MLflow UI page), and ``knnssd
bench``'s mask ablation must run the same drafter without its mask on eval prompts, with the same
output. How much the mask gains is a measurement, shown by the bench table (see the README), not
asserted in a timed test.
"""
import pytest

from knnssd import tracking
from knnssd.bench.bank import BenchConfig
from knnssd.bench.bank import run as bench
from knnssd.bench.planted import plant, save
from knnssd.routing import bank as banks
from conftest import FLOW_DTYPE
from test_integration_calibrate import small_inputs

pytestmark = pytest.mark.integration


def test_calibration_skips_the_planted_sublayers(smollm2, data_dir, prefect_harness, tmp_path, monkeypatch):
    from knnssd.flows.calibrate import CalibrateParams, calibrate

    planted = plant(smollm2.model, count=8, every=3)
    folder = save(planted, smollm2.tokenizer, tmp_path / "smollm2-planted")
    monkeypatch.setenv("KNNSSD_WORK", str(tmp_path / "work"))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params = CalibrateParams(model=str(folder), dtype=FLOW_DTYPE, inputs=small_inputs(data_dir, tmp_path / "in", ("reasoning",), n=4),
                             k_per_domain=1, proxy_trials=8, real_candidates=2, proxy_prompts=2, real_prompts=1,
                             max_new_tokens=24, kinds=["layer_skip", "hybrid"], storage=str(tmp_path / "studies.journal"),
                             tracking_uri=uri)
    reg = calibrate(params)
    bank_dir = tracking.download_bank(f"models:/{reg['name']}@champion", tmp_path / "dl", uri)
    bank = banks.load(bank_dir)
    assert bank.model == str(folder.resolve())  # a folder model's bank loads it again (bench below, generate, serve)
    assert bank.n_layers == 38 and "skip_heatmap.png" in {p.name for p in bank_dir.iterdir()}
    (cluster,) = bank.clusters
    mask = cluster.mask
    found = sum(mask.attn[i] for i in planted.layers) + sum(mask.mlp[i] for i in planted.layers)
    assert found >= 0.8 * 2 * len(planted.layers), (cluster.config, planted.layers)
    from mlflow import MlflowClient

    shown = MlflowClient(uri).get_model_version(reg["name"], reg["version"]).description  # what the UI shows
    assert "pictures%2Fskip_heatmap.png" in shown and f"{mask.n_skipped}/76" in shown

    rep = bench(BenchConfig(bank=str(bank_dir), dtype=FLOW_DTYPE, data=data_dir, domains=("reasoning",), ood=(),
                            prompts=2, ood_prompts=0, max_new_tokens=24, repeats=1, ratios=(0.0,), hf=False,
                            out=tmp_path / "bench", tracking_uri=uri), log=lambda msg: None)
    (row,) = rep["mask_ablation"]
    assert row["cluster"] == cluster.id and row["skipped"] == mask.n_skipped and row["prompts"] == 2
    assert row["mask_gain"] is not None
    for method in ("knn_routed", "knn_unmasked"):
        assert rep["mixed"][method]["agreement_with_ar"] == 1.0
    assert "Mask ablation" in (tmp_path / "bench" / "bench.md").read_text()
