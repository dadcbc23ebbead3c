"""The bench's summary (``bench/bank_summary.py``): routed over the best fixed drafter of each set."""


def test_the_bench_puts_routed_over_the_best_fixed_drafter_of_each_set():
    from knnssd.bench.bank_summary import best_fixed, targets, versus_best_fixed

    sp = lambda **kw: {m: {"speedup_vs_ar": v} for m, v in kw.items()}  # noqa: E731
    rep = {"mixed": sp(ar=1.0, ngram=1.4, suffix=1.5, knn_routed=1.65),
           "per_domain": {"sql": sp(ngram=2.0, suffix=1.0, knn_routed=1.9), "story": sp(knn_routed=1.2)},
           "ood": {"math": {**sp(ngram=1.1, suffix=1.2, knn_routed=1.2), "routed_labels": {"sql": 2}}},
           "streams": {"1.0": {"pass0": {"ngram": 1.3, "suffix": 1.6, "knn_routed": 1.7}}}}
    assert best_fixed(rep["streams"]["1.0"]["pass0"]) == ("suffix", 1.6)  # a stream's row holds plain speedups
    assert best_fixed(rep["per_domain"]["story"]) is None
    rep["versus_best_fixed"] = vs = versus_best_fixed(rep)
    assert set(vs) == {"mixed", "sql", "math"}  # story: no fixed drafter ran there
    assert vs["mixed"]["best_fixed"] == "suffix" and abs(vs["mixed"]["routed_over_best_fixed"] - 1.1) < 1e-9
    t = targets(rep)
    assert abs(t["routed_over_best_fixed"] - 1.1) < 1e-9 and abs(t["routed_over_best_fixed_worst_set"] - 0.95) < 1e-9
