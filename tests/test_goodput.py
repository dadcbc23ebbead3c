"""The goodput rule (``draft_policy.Goodput``): each lookup draft cut to the length that pays, in decoding and in the
search's simulator alike, with plain decoding's tokens."""
import pytest

from knnssd.engine.spec import draft_policy
from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.model.build import make_decoder
from knnssd.engine.spec.drafters import DrafterConfig, build
from knnssd.engine.model.pass_costs import PassCosts, price_sequences
from knnssd.search import proxy
from knnssd.search.costs import Costs
from tiny import prompt_ids, tiny

STEEP = [1.0 + 0.3 * t for t in range(12)]  # ms: each drafted row costs 30% of a plain step, so drafts get cut


def test_a_state_whose_drafts_are_accepted_drafts_them_whole_and_one_whose_are_not_decodes_plainly():
    g, cost = draft_policy.Goodput(), lambda rows: STEEP[rows - 1]
    good, bad = draft_policy.goodput_state(8, (3, 3)), draft_policy.goodput_state(8, (1, 0))
    assert good == (2, 2) and bad == (2, 1)
    for _ in range(20):
        g.observe(good, list(range(8)), 8, [*range(8), 99])  # all 8 accepted, and the next token
        g.observe(bad, list(range(8)), 8, [42])  # the first rejected
    assert g.length(good, 8, cost) == 8 and g.length(bad, 8, cost) == 0
    assert g.length((0, 0), 8, cost) < 8  # a state never seen leans on all states' figures, shrunk towards 1/2


def test_a_cut_draft_still_shows_whether_its_next_token_would_have_been_accepted():
    assert draft_policy.verified([5, 6, 7], 0, [5]) == (1, 1)  # cut to nothing: the model's own token was the draft's
    assert draft_policy.verified([5, 6, 7], 0, [9]) == (1, 0)
    assert draft_policy.verified([5, 6, 7], 1, [5, 6]) == (2, 2)
    assert draft_policy.verified([5, 6, 7], 2, [5, 9]) == (2, 1)  # a rejection ends what the step shows
    assert draft_policy.verified([5, 6, 7], 3, [5, 6, 7, 1]) == (3, 3)  # nothing past the draft


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_goodput_decoding_gives_plain_tokens_and_the_simulators_counts(kind):
    """The simulator cuts the drafts decoding cuts, at the same prices: the same acceptance and mean accepted,
    and fewer drafted tokens than the same drafter uncut."""
    dec = make_decoder(tiny("llama"))
    price_sequences(dec, PassCosts(tuple(range(1, 13)), tuple(ms / 1e3 for ms in STEEP)))
    costs = Costs(verify=STEEP, draft={"full": (1.0, 0.0, 0.0)})
    sizes = (2, 1)
    for i in (1, 3):
        ids = prompt_ids("llama", i)
        cont, _ = generate(dec, ids, None, GenerationConfig(max_new_tokens=40))
        s = proxy.Sample(ids, cont)
        props = [proxy.suffix_proposals(s, 10) if kind == "suffix" else proxy.ngram_proposals(s, sizes, 10)]
        policy = proxy.Policy(kind, 6, ngram_sizes=sizes, goodput=True)
        _, acc, mean = proxy.simulate([s], None, policy, costs, 1.0, props)
        out, st = generate(dec, ids, build(proxy.to_config(policy, None, False), 4), GenerationConfig(max_new_tokens=40))
        _, whole = generate(dec, ids, build(proxy.to_config(proxy.Policy(kind, 6, ngram_sizes=sizes), None, False), 4),
                            GenerationConfig(max_new_tokens=40))
        assert out == cont
        assert acc == pytest.approx(st.acceptance_rate) and mean == pytest.approx(st.mean_accepted)
        assert st.drafted < whole.drafted


@pytest.mark.parametrize("bad", [dict(kind="layer_skip"), dict(kind="ngram", adaptive=True),
                                 dict(kind="suffix", tree=4), dict(kind="ngram", goodput="yes")])
def test_goodput_is_for_lookup_chains_alone(bad):
    with pytest.raises(ValueError, match="goodput"):
        DrafterConfig(**{"goodput": True, **bad})
