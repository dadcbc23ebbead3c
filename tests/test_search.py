"""The proxy simulation replays the real speculative loop (``draft_policy``'s rules) exactly where its traces are
the drafts the loop makes: n-gram drafting, and layer-skip drafts with no sub-layer skipped."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.spec.drafters import build
from knnssd.engine.model.build import make_decoder
from knnssd.engine.spec import suffix
from knnssd.engine.model.skip import SkipMask
from knnssd.engine.spec.suffix import SequenceIndex
from knnssd.search import proxy, study
from knnssd.search.costs import Costs, measure_costs
from tiny import prompt_ids, tiny


COSTS = Costs(verify=[1.0 + 0.05 * t for t in range(12)], draft={"full": (1.0, 0.0, 0.0)})
TREE_COSTS = Costs(COSTS.verify, COSTS.draft, tree=[1.5 + 0.1 * t for t in range(11)])


def _simulated_as_run(dec, i: int, n: int, policy: proxy.Policy, traced: bool) -> None:
    """Prompt ``i``'s plain continuation of ``n`` tokens, simulated under ``policy`` (over traces of the full
    model where ``traced``) and decoded with its drafter: the same tokens, acceptance and mean accepted."""
    ids = prompt_ids("llama", i)
    cont, _ = generate(dec, ids, None, GenerationConfig(max_new_tokens=n))
    s = proxy.Sample(ids, cont)
    traces = proxy.trace(dec, [s], SkipMask.none(4), False, 64) if traced else None
    props = [proxy.suffix_proposals(s, 10) if policy.kind == "suffix" else proxy.ngram_proposals(s, policy.ngram_sizes, 10)]
    trees = proxy.Trees([s], 10, None if policy.kind == "suffix" else policy.ngram_sizes) if policy.tree else None
    _, acc, mean = proxy.simulate([s], traces, policy, TREE_COSTS, 1.0, props, trees)
    cfg = proxy.to_config(policy, SkipMask.none(4) if traced else None, False)
    out, st = generate(dec, ids, build(cfg, 4), GenerationConfig(max_new_tokens=n))
    assert out == cont
    assert acc == pytest.approx(st.acceptance_rate) and mean == pytest.approx(st.mean_accepted)


@pytest.mark.parametrize("adaptive", [False, True])
def test_simulated_ngram_counts_equal_real_loop(adaptive):
    dec = make_decoder(tiny("llama"))
    for i in (1, 3):
        _simulated_as_run(dec, i, 40, proxy.Policy("ngram", 5, adaptive=adaptive, ngram_sizes=(2, 1)), traced=False)


@pytest.mark.parametrize("adaptive", [False, True])
def test_simulated_suffix_counts_equal_real_loop(adaptive):
    dec = make_decoder(tiny("llama"))
    for i in (1, 3):
        _simulated_as_run(dec, i, 40, proxy.Policy("suffix", 6, adaptive=adaptive), traced=False)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("nodes", [4, 11])
def test_simulated_tree_counts_equal_real_loop(adaptive, nodes):
    """Trees where the sequence has earlier matches, a one-leaf tree as a chain, the suffix chain where it has
    none: the simulator drafts and accepts what the real loop does, for suffix and n-gram trees."""
    dec = make_decoder(tiny("llama"))
    for i in (1, 3):
        _simulated_as_run(dec, i, 40, proxy.Policy("suffix", 6, adaptive=adaptive, tree=nodes), traced=False)
        _simulated_as_run(dec, i, 40, proxy.Policy("ngram", 6, adaptive=adaptive, ngram_sizes=(2, 1), tree=nodes),
                          traced=False)


@settings(max_examples=60, deadline=None)
@given(toks=st.lists(st.integers(0, 3), min_size=2, max_size=60), budget=st.integers(1, 11), depth=st.integers(1, 10))
def test_a_tree_selected_from_a_deeper_ranking_is_the_drafters(toks, budget, depth):
    index = SequenceIndex()
    index.extend(toks)
    assert suffix.select(suffix.ranked(index, 10), budget, depth) == suffix.draft_tree(index, budget, depth)


def test_trees_are_searched_where_their_pass_was_measured():
    """Two continuations of "5 6" alternate: a chain drafts the more frequent one, a tree both."""
    a, b = [5, 6, 7, 8], [5, 6, 9, 10]
    samples = [proxy.Sample(a + b + a, (b + a) * 5), proxy.Sample(b + a + b, (a + b) * 5)]
    props = {"suffix": [proxy.suffix_proposals(s, 10) for s in samples], (proxy.TREE_KEY, "suffix"): proxy.Trees(samples, 10)}
    for sizes in proxy.NGRAM_SIZES:
        props[sizes] = [proxy.ngram_proposals(s, sizes, 10) for s in samples]
        props[(proxy.TREE_KEY, sizes)] = proxy.Trees(samples, 10, sizes)
    cheap = Costs(COSTS.verify, COSTS.draft, tree=[0.01] * 11)
    for kind in ("suffix", "ngram"):
        assert proxy.best_policy(samples, None, COSTS, 0.0, props, (kind,))[0].tree == 0  # no tree pass measured
        pol = proxy.best_policy(samples, None, cheap, 0.0, props, (kind,))[0]
        assert pol.tree in proxy.TREES and pol.tree > 0
        assert proxy.to_config(pol, None, False).tree == pol.tree
    costs = measure_costs(make_decoder(tiny("llama")), max_t=6, context=40)
    assert len(costs.tree) == 5 and all(ms > 0 for ms in costs.tree) and costs.tree_ms(9, 2) == costs.tree[-1]
    assert costs.tree_leaf >= 0 and costs.tree_ms(5, 4) == costs.tree[3] + 2 * costs.tree_leaf


def test_a_search_may_take_suffix_and_picks_its_best_pure_policy():
    from knnssd.engine.spec.drafters import KINDS
    from knnssd.search.budget import SEARCHED, Budget

    assert Budget(kinds=["suffix"]).kinds == ("suffix",) and "suffix" not in Budget().kinds
    with pytest.raises(ValueError, match="choose from layer_skip, ngram, hybrid, suffix"):
        Budget(kinds=["tree"])
    dec = make_decoder(tiny("llama"))
    samples = []
    for i in (1, 3):
        cont, _ = generate(dec, prompt_ids("llama", i), None, GenerationConfig(max_new_tokens=30))
        samples.append(proxy.Sample(prompt_ids("llama", i), cont))
    props = {"suffix": [proxy.suffix_proposals(s, 10) for s in samples]}
    pol, (speedup, acc, mean) = proxy.best_policy(samples, None, COSTS, 0.0, props, ("suffix",))
    assert pol.kind == "suffix" and pol.threshold == 0.0 and speedup > 0 and mean >= 1.0
    assert proxy.to_config(pol, None, False).kind == "suffix"
    assert set(SEARCHED) == set(KINDS) - {"none"}  # every kind a bank may hold, but plain


@pytest.mark.parametrize("kind,threshold,adaptive", [("layer_skip", 0.6, False), ("hybrid", 0.6, True)])
def test_simulated_confidence_stops_and_hybrid_choice_equal_real_loop(kind, threshold, adaptive):
    """With no sub-layer skipped, a trace's confidences are the loop's draft confidences: the threshold stop,
    the hybrid's choice, the cap and the adapted length must then give the loop's counts exactly."""
    dec = make_decoder(tiny("llama"))
    for i in (0, 2):
        _simulated_as_run(dec, i, 30, proxy.Policy(kind, 6, threshold, adaptive, (2, 1)), traced=True)


def test_simulated_exact_drafts_are_all_accepted():
    dec = make_decoder(tiny("qwen3"))
    ids = prompt_ids("qwen3", 0)
    cont, _ = generate(dec, ids, None, GenerationConfig(max_new_tokens=30))
    s = proxy.Sample(ids, cont)
    traces = proxy.trace(dec, [s], SkipMask.none(4), False, 64)
    costs = Costs(verify=[10.0] * 12, draft={"full": (2.0, 0.0, 0.0)})
    sp, acc, mean = proxy.simulate([s], traces, proxy.Policy("layer_skip", 4), costs, 2.0, None)
    assert acc == 1.0 and mean == pytest.approx(29 / 6)  # 29 tokens after the prefill's, in steps of <= 5
    assert sp > 1.5


def test_cost_model_is_linear_in_kept_sublayers():
    dec = make_decoder(tiny("llama"))
    costs = measure_costs(dec, max_t=4, context=16)
    assert len(costs.verify) == 4 and set(costs.draft) == {"full", "int8"}
    none, half = SkipMask.none(4), SkipMask.from_layers(4, attn=[0, 1], mlp=[2, 3])
    assert costs.draft_ms(half, False) <= costs.draft_ms(none, False)


def test_int8_drafts_are_searched_only_where_measured_faster():
    """On CUDA ``_weight_int8pack_mm`` made an int8 draft step slower than a full bf16 one: the search then
    leaves int8 out, by the costs it measured (here given)."""
    fast = Costs(verify=[10.0], draft={"full": (1.0, 0.2, 0.3), "int8": (1.0, 0.1, 0.2)})
    slow = Costs(verify=[10.0], draft={"full": (1.0, 0.2, 0.3), "int8": (2.0, 0.3, 0.5)})
    assert fast.int8_pays(4) and not slow.int8_pays(4)
    assert not Costs(verify=[10.0], draft={"full": (1.0, 0.2, 0.3)}).int8_pays(4)


def test_influence_finds_planted_zero_layers_and_the_first_mask_skips_exactly_them():
    from knnssd.bench.planted import plant

    p = plant(tiny("llama"), count=2, every=2)
    assert p.layers == (2, 5) and p.n_layers == 6
    dec = make_decoder(p.model)
    ids = prompt_ids("llama", 0)
    base = make_decoder(tiny("llama")).forward(torch.tensor(ids), 0).logits
    assert torch.allclose(dec.forward(torch.tensor(ids), 0).logits, base, atol=1e-5)  # the planted layers add nothing
    sizes = proxy.influence(dec, [proxy.Sample(ids, ids[:6])], context=64)
    assert sizes.shape == (2, 6)
    assert all(sizes[r, i] == 0 for r in range(2) for i in p.layers)
    assert all(sizes[r, i] > 0 for r in range(2) for i in range(6) if i not in p.layers)
    first = proxy.influence_masks(sizes)[0]
    assert first == SkipMask.from_layers(6, attn=p.layers, mlp=p.layers)
    assert study.trial_mask(study.trial_params(first, True), 6) == first


def test_search_settings_are_declared_once():
    """Budget is the one declaration: the flow parameters and the CLI options are made from it, with its
    defaults, and prefect.yaml restates none of them."""
    import dataclasses
    from pathlib import Path

    import yaml

    from knnssd.cli import parser
    from knnssd.flows.add_domain import AddDomainParams
    from knnssd.flows.calibrate import CalibrateParams
    from knnssd.search.budget import Budget

    budget = Budget()
    names = [f.name for f in dataclasses.fields(Budget)]
    assert CalibrateParams().budget() == budget
    assert all(n in AddDomainParams.model_fields for n in names)
    for cmd in ("calibrate", "search-worker", "add-domain"):
        argv = [cmd, "--name", "x", "--input", "f"] if cmd == "add-domain" else [cmd]
        a = parser().parse_args(argv)
        assert Budget(**{n: getattr(a, n) for n in names}) == budget, cmd
    a = parser().parse_args(["calibrate", "--trials", "3", "--kinds", "ngram", "--no-int8", "--minutes", "1.5"])
    assert (a.proxy_trials, a.kinds, a.int8, a.minutes) == (3, ["ngram"], False, 1.5)
    deployments = yaml.safe_load((Path(__file__).parents[1] / "prefect.yaml").read_text())["deployments"]
    for d in deployments:
        restated = set((d.get("parameters") or {}).get("params") or {}) & set(names)
        assert not restated, f"prefect.yaml deployment {d['name']} restates {sorted(restated)}"


def test_workers_that_start_together_search_with_the_first_ones_settings(tmp_path):
    """Two search workers opened a study together, each found no stored step costs, measured its own and
    stored them as study attributes, where the last write wins: one searched int8 drafts, the other did
    not, and failed on a trial the first had enqueued ("'True' not in (False,)"). Worker B here measures
    while worker A measures and stores (the nested call): both must take A's, and only A seeds the study."""
    import optuna

    storage = study.storage_for(str(tmp_path / "journal.log"))
    a, b = (study.open_study(storage, "race") for _ in range(2))
    params = study.trial_params(SkipMask.none(2), False)
    got = {}

    def b_measures():
        got["a"] = study.first_settings(a, lambda: {"int8": True}, params)
        return {"int8": False}

    got["b"] = study.first_settings(b, b_measures, params)
    (a_settings, a_seeds), (b_settings, b_seeds) = got["a"], got["b"]
    assert a_settings == b_settings and a_settings["int8"] is True and (a_seeds, b_seeds) == (True, False)
    assert study.first_settings(study.open_study(storage, "race"), lambda: pytest.fail("measured again"), params)[0] == a_settings
    waiting = [t for t in a.get_trials() if t.state == optuna.trial.TrialState.WAITING]
    assert len(waiting) == 2  # each the unmasked full-precision draft, valid whichever settings win
