"""Speculative sampling keeps the model's distribution exactly.

Tolerance: a chi-square goodness-of-fit test against the exact distribution (enumerated from
the model) must not reject at p < 0.001; cells with expected count < 5 are pooled. Seeds are
fixed, so a pass or fail is reproducible, not flaky.
"""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from knnssd.engine.spec.loop import GenerationConfig, decode, prefill
from knnssd.engine.spec.drafters import DrafterConfig, build
from knnssd.engine.spec.sampling import Verdict, Warp, accept_greedy, accept_sampled, probs
from knnssd.engine.spec.sequence import Sequence
from knnssd.engine.model.build import make_decoder
from knnssd.engine.model.skip import SkipMask
from tiny import prompt_ids, tiny

ALPHA = 1e-3
N = 1500


def chi2_pvalue(counts: dict, expected_p: dict, n: int) -> float:
    keys = sorted(expected_p, key=lambda k: expected_p[k])
    obs, exp, o_acc, e_acc = [], [], 0.0, 0.0
    for k in keys:  # pool the rarest cells until each pooled cell expects >= 5
        o_acc += counts.get(k, 0)
        e_acc += expected_p[k] * n
        if e_acc >= 5:
            obs.append(o_acc), exp.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc:
        obs[-1] += o_acc
        exp[-1] += e_acc
    assert sum(counts.get(k, 0) for k in counts if k not in expected_p) == 0, "sampled a token outside the support"
    return float(chisquare(np.array(obs), np.array(exp) * (sum(obs) / sum(exp))).pvalue)


def rejection_verify(x, q, p, g, kept=None) -> tuple[int, int]:
    v = Verdict.read(accept_sampled(x, q, p, g, kept))
    return v.accepted, v.next


def greedy_verify(x, logits, kept=None) -> tuple[int, int]:
    v = Verdict.read(accept_greedy(x, logits, kept))
    return v.accepted, v.next


def test_rejection_verify_single_position_matches_target():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]])
    counts: dict[int, int] = {}
    n = 20000
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g)
        acc, nxt = rejection_verify(x, q, p, g)
        first = int(x[0]) if acc == 1 else nxt
        counts[first] = counts.get(first, 0) + 1
    expected = {i: float(p[0, i]) for i in range(5) if p[0, i] > 0}
    assert chi2_pvalue(counts, expected, n) > ALPHA
    # a point-mass draft (n-gram) is accepted with probability p(x)
    hits = sum(rejection_verify(torch.tensor([0]), None, p, g)[0] for _ in range(4000))
    assert abs(hits / 4000 - 0.5) < 0.03


def test_rejection_verify_cut_draft_samples_the_bonus_position():
    """A draft cut on the device to ``kept`` = 1 of 2 tokens: once its first token is accepted, the next
    token is a sample of p_2 (the bonus position of the cut draft), never of the residual there."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.3, 0.7], [0.0, 0.0, 1.0]])
    counts: dict[int, int] = {}
    for _ in range(4000):
        acc, nxt = rejection_verify(torch.tensor([0, 2]), None, p, g, kept=torch.tensor(1))
        assert acc == 1  # p_1(0) = 1, and the second drafted token is never verified
        counts[nxt] = counts.get(nxt, 0) + 1
    assert chi2_pvalue(counts, {1: 0.3, 2: 0.7}, 4000) > ALPHA


def test_rejection_verify_with_draft_distributions_and_a_cut_draft():
    """Two drafted tokens, q given, the draft cut to ``kept`` = 1: the first emitted token follows p_1 (accepted
    draft or residual sample), and the second is p_2's whenever the first draft was accepted."""
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.2, 0.2, 0.6], [0.3, 0.3, 0.4]])
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    n = 12000
    for _ in range(n):
        x = torch.cat((torch.multinomial(q[0], 1, generator=g), torch.tensor([2])))
        v = Verdict.read(accept_sampled(x, q, p, g, kept=torch.tensor(1)))
        assert v.accepted <= 1 and v.drafted == (int(x[0]),)
        tok = v.emitted[0]
        first[tok] = first.get(tok, 0) + 1
        if v.accepted:
            second[v.next] = second.get(v.next, 0) + 1
    assert chi2_pvalue(first, {i: float(p[0, i]) for i in range(3)}, n) > ALPHA
    assert chi2_pvalue(second, {i: float(p[1, i]) for i in range(3)}, sum(second.values())) > ALPHA


def test_greedy_verify():
    logits = torch.tensor([[0.0, 5, 0], [9, 0, 0], [0, 0, 3]])
    assert greedy_verify(torch.tensor([1, 0]), logits) == (2, 2)
    assert greedy_verify(torch.tensor([1, 2]), logits) == (1, 0)
    assert greedy_verify(torch.tensor([2, 0]), logits) == (0, 1)
    assert greedy_verify(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 1)
    assert greedy_verify(torch.tensor([1, 0]), logits, kept=torch.tensor(1)) == (1, 0)  # cut: best at position 1
    v = Verdict.read(accept_greedy(torch.tensor([1, 0]), logits, torch.tensor(1)))
    assert v.drafted == (1,) and v.emitted == [1, 0]


def test_warp_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert (probs(logits, Warp(1.0, top_k=2)) > 0).tolist() == [True, True, False, False]
    p = probs(logits, Warp(1.0, top_p=0.7))
    assert (p > 0).sum() == 2 and torch.isclose(p.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError):
        Warp(-1.0)


def exact_joint(model, prompt: list[int], warp: Warp, length: int = 3) -> dict:
    """P(first `length` tokens) under plain sampling, by enumerating the warped support."""
    out = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, pr in out.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            p = probs(logits, warp)
            for t in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (t,)] = pr * float(p[t])
        out = nxt
    return out


@pytest.mark.parametrize("kind,warp", [
    ("none", Warp(0.8, top_k=4)),
    ("layer_skip", Warp(0.8, top_k=4)),  # drafted with no host read, cut at the threshold on the device
    ("ngram", Warp(1.0, top_k=3)),
    ("suffix", Warp(1.0, top_k=3)),  # a chain of point masses, as n-gram's
    ("suffix tree", Warp(1.0, top_k=3)),  # a drafter of token trees: sampled runs verify its chains
    ("hybrid", Warp(1.2, top_k=5, top_p=0.9)),
])
def test_speculative_sampling_distribution(kind, warp):
    kind, tree = kind.split()[0], 8 if kind.endswith(" tree") else 0
    model = tiny("llama")
    dec = make_decoder(model)
    prompt = prompt_ids("llama", 1)
    if kind in ("ngram", "suffix"):  # every token occurs in the prompt, so a lookup always proposes something
        prompt = list(range(2, model.config.vocab_size)) + prompt
    expected = exact_joint(model, prompt, warp)
    cfg = DrafterConfig(kind=kind, mask=SkipMask.from_layers(4, attn=[2], mlp=[1]).to_dict(), max_len=3,
                        ngram_sizes=[2, 1], threshold=0.4, tree=tree)
    drafter = build(cfg, dec.n_layers)
    if kind == "layer_skip":  # hybrid's layer-skip part stops early, at the threshold, as on a CPU
        drafter.early_stop = False
    counts: dict[tuple, int] = {}
    drafted = 0
    # generate() is prefill() then decode(); the prompt's K/V and logits do not depend on the seed, so
    # the prompt runs once and each seed decodes from it (later positions are overwritten each time)
    _, logits, _ = prefill(dec, prompt, GenerationConfig(max_new_tokens=4, warp=warp, seed=0))
    for seed in range(N):
        gen = torch.Generator().manual_seed(seed)
        seq = Sequence(list(prompt), len(prompt), dec, warp, gen, dec.device)
        out, stats = decode(seq, logits, drafter, GenerationConfig(max_new_tokens=4, warp=warp, seed=seed))
        key = tuple(out[:3])
        counts[key] = counts.get(key, 0) + 1
        drafted += stats.drafted
    if kind != "none":
        assert drafted > N / 2, "the drafter should have proposed tokens"
    assert chi2_pvalue(counts, expected, N) > ALPHA
