import json
import math
import re

import numpy as np
import pytest

from knnssd.engine.spec.drafters import DrafterConfig
from knnssd.engine.model.skip import SkipMask
from knnssd.routing import bank as banks
from knnssd.routing import router


def blobs(n_per=20, dim=16, centers=3, seed=0):
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(centers, dim)) * 3
    x = np.concatenate([c[i] + rng.normal(size=(n_per, dim)) * 0.3 for i in range(centers)])
    labels = [f"d{i}" for i in range(centers) for _ in range(n_per)]
    return x.astype(np.float32), labels


def test_labelled_clusters_route_their_own_domain():
    x, labels = blobs()
    ids = [f"p{i}" for i in range(len(x))]
    clusters = router.build_clusters(ids, labels, x, k_per_domain=4)
    assert [c.label for c in clusters] == ["d0", "d1", "d2"] and all(len(c.anchors) == 4 for c in clusters)
    r = router.Router.from_clusters(clusters, k=3)
    routed = [clusters[r.route(v).cluster].label for v in x]
    assert routed == labels


def test_unlabelled_pool_picks_k_by_silhouette_and_threshold_marks_unmatched():
    x, labels = blobs(centers=4)
    clusters = router.build_clusters([str(i) for i in range(len(x))], [None] * len(x), x)
    assert len(clusters) == 4 and sum(len(c.members) for c in clusters) == len(x)
    r = router.Router.from_clusters(clusters, k=1, min_similarity=0.9)
    far = -router.normalize(x[:1])[0]
    assert r.route(far).cluster is None
    assert r.route(x[0]).cluster is not None


def test_pooling():
    import torch

    h = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 3.0]])
    assert np.allclose(router.Pooling("last").pool(h), [0, 1])
    assert np.allclose(router.Pooling("mean").pool(h), router.normalize(np.array([1 / 3, 4 / 3])))
    with pytest.raises(ValueError):
        router.Pooling("max")


def make_bank(tmp_path, n_layers=4):
    x, labels = blobs(n_per=6, dim=8)
    clusters = router.build_clusters([str(i) for i in range(len(x))], labels, x, k_per_domain=2)
    cfg = DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(n_layers, mlp=[1]).to_dict(), int8=True).to_dict()
    results = [banks.ClusterResult(c.id, cfg, speedup=1.3 + c.id / 10, acceptance_rate=0.7, mean_accepted=2.1)
               for c in clusters]
    b = banks.from_clusters(clusters, results, "tiny", "abc", n_layers, "float32", router.Pooling(), 0.2, "now")
    return b, b.save(tmp_path / "bank")


def test_bank_round_trip_and_validation(tmp_path):
    b, folder = make_bank(tmp_path)
    loaded = banks.load(folder)
    assert loaded.to_json() == b.to_json() and np.allclose(loaded.anchors, b.anchors)
    assert loaded.fallback == 2  # fastest over the most prompts
    with pytest.raises(banks.BankError, match="fingerprint"):
        loaded.check_model("other", 4)
    with pytest.raises(banks.BankError, match="4-layer"):
        loaded.check_model("abc", 5)

    d = json.loads((folder / "bank.json").read_text())
    d["clusters"][0]["config"]["mask"]["n_layers"] = 3
    (folder / "bank.json").write_text(json.dumps(d))
    with pytest.raises(banks.BankError, match="cluster 0"):
        banks.load(folder)
    (folder / "bank.json").write_text("{not json")
    with pytest.raises(banks.BankError, match="corrupt"):
        banks.load(folder)
    (folder / "anchors.parquet").write_bytes(b"junk")
    (folder / "bank.json").write_text(json.dumps(b.to_json()))
    with pytest.raises(banks.BankError, match="anchors.parquet"):
        banks.load(folder)
    with pytest.raises(banks.BankError, match="no bank.json"):
        banks.load(tmp_path / "nowhere")


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(min_similarity=float("nan")), "router.min_similarity must be a finite number"),
    (lambda r: r.update(min_similarity=float("inf")), "router.min_similarity must be a finite number"),
    (lambda r: r.update(k=0), "router.k must be an integer >= 1, got 0"),
    (lambda r: r.update(k=2.5), "router.k must be an integer >= 1, got 2.5"),
    (lambda r: r.update(center=[float("nan")] * len(r["center"])), "router center contains NaN"),
    (lambda r: r.update(center=[0.0]), "router center has shape (1,)"),
])
def test_router_values_that_cannot_route_are_refused(tmp_path, edit, message):
    """Trial 4, D4-D5: a NaN threshold or a k of 0 was taken (every prompt unmatched, or no neighbour),
    and a NaN center was reported as a dimension mismatch."""
    b, folder = make_bank(tmp_path)
    d = json.loads((folder / "bank.json").read_text())
    d["router"]["center"] = d["router"].get("center") or [0.0] * b.anchors.shape[1]
    edit(d["router"])
    (folder / "bank.json").write_text(json.dumps(d))  # json writes NaN, as a hand edit could
    with pytest.raises(banks.BankError, match=re.escape(message)):
        banks.load(folder)


def test_pictures(tmp_path):
    from knnssd.routing import pictures

    b, folder = make_bank(tmp_path)
    assert pictures.skip_heatmap(b, tmp_path / "h.png").stat().st_size > 1000
    x, labels = blobs(n_per=6, dim=8)
    assert pictures.anchor_map(b, router.normalize(x), labels, tmp_path / "m.png").stat().st_size > 1000


def test_threshold_is_held_out_so_unseen_in_domain_prompts_match_with_few_calib_prompts():
    x, labels = blobs(n_per=12, dim=16, centers=3, seed=3)
    calib = [i for i in range(len(x)) if i % 12 < 4]  # 4 calib prompts per domain, 2 anchors each
    held = [i for i in range(len(x)) if i % 12 >= 4]
    ids = [str(i) for i in calib]
    center = router.center_of(x[calib])
    clusters = router.build_clusters(ids, [labels[i] for i in calib], x[calib], k_per_domain=2, center=center)
    thr = router.unmatched_threshold(ids, router.centered(x[calib], center), clusters)
    r = router.Router.from_clusters(clusters, k=3, min_similarity=thr, center=center)
    routed = [r.route(x[i]) for i in held]
    assert all(rt.cluster is not None for rt in routed)
    assert [clusters[rt.cluster].label for rt in routed] == [labels[i] for i in held]
    assert r.route(-x[0]).cluster is None


def test_bank_tuned_in_another_dtype_warns_and_still_loads(tmp_path, caplog):
    from dataclasses import replace

    from knnssd import models
    from knnssd.serving.routed import RoutedGenerator
    from tiny import tiny

    b, _ = make_bank(tmp_path)
    lm = models.LoadedModel(name="tiny", model=tiny("llama"), tokenizer=None, source="tiny", fingerprint="abc")
    with caplog.at_level("WARNING", logger="knnssd.engine"):
        RoutedGenerator(lm, b)
        assert not caplog.records
        RoutedGenerator(lm, replace(b, dtype="bfloat16"))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["bank was tuned in bfloat16 and runs in float32"]


def test_prompt_vectors_of_another_precision_are_not_taken_from_the_cache(monkeypatch, tmp_path):
    """The weights' fingerprint is the same in fp32 and bf16; their prompt vectors are not, and a calibration in
    one precision must not build its anchors from vectors the other computed."""
    import torch

    from knnssd import prompts
    from knnssd.search import steps
    from test_graphed_generation import loaded
    from tiny import prompt_ids

    rows = [prompts.Prompt(str(i), " ".join(map(str, prompt_ids("llama", i))), "d") for i in range(3)]
    got = {}
    for dtype in (torch.float32, torch.bfloat16):
        lm = loaded(dtype)
        monkeypatch.setattr(steps, "runtime", lambda spec, lm=lm: (lm, lm.decoder))
        got[dtype] = steps.embed(steps.ModelSpec("tiny", "auto"), rows, cache_dir=tmp_path)
    assert got[torch.float32] != got[torch.bfloat16]
    (_, _, a), (_, _, b) = (router.load_vectors(p) for p in got.values())
    assert not np.array_equal(a, b)


def test_prompt_vectors_under_another_config_are_not_taken_from_the_cache(monkeypatch, tmp_path):
    """The same weights under an edited config (the norms' epsilon) compute other vectors: a calibration must not
    take the other config's from the cache (the weights' fingerprint, the same for both, keyed them before)."""
    import copy

    from knnssd import models, prompts
    from knnssd.search import steps
    from test_graphed_generation import Tokens
    from tiny import prompt_ids, tiny

    rows = [prompts.Prompt(str(i), " ".join(map(str, prompt_ids("llama", i))), "d") for i in range(3)]
    model = tiny("llama")
    edited = copy.deepcopy(model)
    edited.config.rms_norm_eps = model.config.rms_norm_eps * 10
    got = []
    for m in (model, edited):
        lm = models.LoadedModel(name="tiny", model=m, tokenizer=Tokens(), source="tiny", fingerprint="abc")
        monkeypatch.setattr(steps, "runtime", lambda spec, lm=lm: (lm, lm.decoder))
        got.append(steps.embed(steps.ModelSpec("tiny", "auto"), rows, cache_dir=tmp_path))
    assert got[0] != got[1]


def _candidate(cfg: DrafterConfig, speedup: float, ar_ms: float = 10.0) -> dict:
    return {"config": cfg.to_dict(), "speedup": speedup, "ar_ms_per_token": ar_ms, "ms_per_token": ar_ms / speedup,
            "acceptance": 0.5, "mean_accepted": 2.0, "proxy_speedup": speedup}


def test_a_tuned_configuration_must_beat_the_fixed_drafters_by_the_timing_noise():
    from knnssd.engine.spec.drafters import untuned
    from knnssd.search.objective import choose, timing_noise

    tuned = DrafterConfig(kind="ngram", max_len=5, ngram_sizes=[4, 3], adaptive=True)
    steady = [_candidate(untuned("suffix"), 1.50), _candidate(untuned("ngram"), 1.40), _candidate(tuned, 1.52)]
    assert timing_noise(steady) == 0.0  # plain decoding timed alike beside every candidate: no noise
    assert choose(steady)["config"] == tuned.to_dict()  # faster, and the timings can tell
    # plain decoding's ms per token 9.4-10.6 beside the candidates: about 6% noise, so 1.52 cannot beat 1.50
    noisy = [_candidate(untuned("suffix"), 1.50, 9.4), _candidate(untuned("ngram"), 1.40, 10.0),
             _candidate(tuned, 1.52, 10.6)]
    best = choose(noisy)
    assert best["config"] == untuned("suffix").to_dict() and best["best_fixed_speedup"] == 1.50
    assert 0.05 < best["timing_noise"] < 0.07
    clear = [*noisy[:2], _candidate(tuned, 1.90, 10.6)]  # beyond the noise: the tuned one
    assert choose(clear)["config"] == tuned.to_dict()
    slow = [_candidate(untuned("suffix"), 0.9), _candidate(untuned("ngram"), 0.95)]
    assert choose(slow)["config"]["kind"] == "none"  # plain decoding where nothing is faster
    assert math.isnan(choose([_candidate(tuned, 1.3)])["best_fixed_speedup"])
    # kinds without lookups (a bank of masks): the fixed drafters are not taken
    assert choose(steady, kinds=("ngram",))["config"] == tuned.to_dict()  # a lookup kind: both may be
    assert choose(steady[:2], kinds=("ngram", "layer_skip"))["config"] == untuned("suffix").to_dict()
    skip = DrafterConfig(kind="layer_skip", mask=SkipMask.from_layers(4, mlp=[1]).to_dict())
    masks_only = choose([*noisy[:2], _candidate(skip, 1.2, 10.0)], kinds=("layer_skip", "hybrid"))
    assert masks_only["config"] == skip.to_dict() and masks_only["best_fixed_speedup"] == 1.50


def test_unmatched_prompts_take_the_fixed_drafter_fastest_over_every_cluster(tmp_path):
    from knnssd.engine.spec.drafters import untuned

    x, labels = blobs(n_per=6, dim=8)
    clusters = router.build_clusters([str(i) for i in range(len(x))], labels, x, k_per_domain=2)
    tuned = DrafterConfig(kind="ngram", max_len=5, ngram_sizes=[4, 3]).to_dict()
    # suffix wins one cluster by a little and loses the others by more: over every prompt, n-gram is faster
    fixed = {0: (1.6, 1.5), 1: (1.2, 1.4), 2: (1.1, 1.3)}
    results = []
    for c in clusters:
        sfx, ngr = fixed[c.id]
        cands = [_candidate(untuned("suffix"), sfx), _candidate(untuned("ngram"), ngr),
                 _candidate(DrafterConfig.from_dict(tuned), 1.7)]
        results.append(banks.ClusterResult(c.id, tuned, speedup=1.7, candidates=cands,
                                           best_fixed_speedup=max(sfx, ngr)))
    b = banks.from_clusters(clusters, results, "tiny", "abc", 4, "float32", router.Pooling(), 0.2, "now")
    assert b.fallback_config == untuned("ngram").to_dict() and 1.3 < b.fallback_speedup < 1.5
    assert b.cluster(None).config == untuned("ngram").to_dict() and b.cluster(None).label == "unmatched"
    assert b.clusters[0].search["margin_over_fixed"] == pytest.approx(1.7 / 1.6)
    assert b.clusters[0].search["fixed"]["suffix"]["speedup"] == 1.6
    loaded = banks.load(b.save(tmp_path / "bank"))
    assert loaded.cluster(None).config == untuned("ngram").to_dict()
    # a bank whose searches did not time the fixed drafters keeps its fallback cluster
    old, _ = make_bank(tmp_path / "old")
    assert old.fallback_config is None and old.cluster(None).id == old.fallback
    d = b.to_json()
    d["router"]["fallback_config"] = {"kind": "ngram", "max_len": -1}
    (tmp_path / "bank" / "bank.json").write_text(json.dumps(d))
    with pytest.raises(banks.BankError, match="router.fallback_config"):
        banks.load(tmp_path / "bank")


def test_a_bank_says_what_its_searches_cost_and_bought(tmp_path):
    """``Bank.searched``: the searches' seconds summed, and the choices over the best fixed drafter weighted by
    members (calibrate's last line); None where no search timed the fixed drafters."""
    x, labels = blobs(n_per=6, dim=8)
    clusters = router.build_clusters([str(i) for i in range(len(x))], labels, x, k_per_domain=1)
    cfg = DrafterConfig(kind="ngram").to_dict()

    def bank(fixed: list[float]):
        results = [banks.ClusterResult(c.id, cfg, speedup=1.2, search_s=10.0 + c.id, best_fixed_speedup=f)
                   for c, f in zip(clusters, fixed)]
        return banks.load(banks.from_clusters(clusters, results, "tiny", "abc", 4, "float32", router.Pooling(), 0.2,
                                              "now").save(tmp_path / str(len(list(tmp_path.iterdir())))))

    b = bank([1.0, 1.2, 1.5][: len(clusters)])
    members = [c.members for c in b.clusters]
    got = b.searched()
    margins = [1.2 / f for f in [1.0, 1.2, 1.5][: len(clusters)]]
    assert got["search_s"] == pytest.approx(sum(10.0 + c.id for c in clusters))
    assert got["margin_over_fixed"] == pytest.approx(sum(m * x for m, x in zip(members, margins)) / sum(members))
    assert bank([math.nan] * len(clusters)).searched()["margin_over_fixed"] is None
