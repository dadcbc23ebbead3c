"""Token trees (engine/model/tree.py): each node's row of a tree pass is bitwise the row its token gets in a
chain, in fp32 and in bf16 where the probe says exact, on trees of several shapes; greedy decoding with
trees gives plain decoding's tokens, whichever branch holds them; sampled runs verify chains."""
import functools

import pytest
import torch
import transformers as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from knnssd.engine.batch import scheduler as batched
from knnssd.engine.model import exactness
from knnssd.engine.model import tree, tree_pass
from knnssd.engine.batch.plan import BatchPlan
from knnssd.engine.batch.scheduler import PromptJob, decode_batch
from knnssd.engine.model.pass_costs import PassCosts
from knnssd.engine.model.attention import NATIVE
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.spec.loop import GenerationConfig, Run, generate, prefill
from knnssd.engine.spec.drafters import Draft, DrafterConfig, Suffix, build
from knnssd.engine.spec.sampling import Warp
from knnssd.engine.model.weights import from_hf
from knnssd.engine.spec.suffix import SequenceIndex, draft_tree
from test_exact_step import DTYPES, STRADDLE, decoder, exact_or_skip, plain
from tiny import ARCHS, COMMON, prompt_ids

SHAPES = {
    "chain": (0, 1, 2, 3, 4),
    "star": (0, 0, 0, 0, 0, 0),
    "two chains": (0, 1, 2, 0, 4, 5),
    "bushy": (0, 0, 1, 1, 2, 2, 3, 4, 8, 9, 10),  # 11 nodes: the longest pass the probe checks
    "late fork": (0, 1, 2, 3, 3, 3, 5),
}


@st.composite
def parents(draw, most: int = exactness.MAX_T - 1):
    n = draw(st.integers(1, most))
    return tuple(draw(st.integers(0, j - 1)) for j in range(1, n + 1))


def test_depths_and_segments_cover_every_node_once():
    p = SHAPES["bushy"]
    assert tree.depths(p) == [0, 1, 1, 2, 2, 2, 2, 3, 3, 4, 5, 6]
    segs = tree.segments(p)
    assert sorted(n for path, j0 in segs for n in path[j0:]) == list(range(len(p) + 1))
    for path, _ in segs:
        assert path[0] == 0 and all(p[b - 1] == a for a, b in zip(path, path[1:]))
    for bad in ((1,), (0, 2), (0, -1), (0, True)):
        with pytest.raises(ValueError, match="parent must be an earlier node"):
            tree.check(bad)


def test_a_whole_branch_accepted_lengthens_adaptive_drafts():
    p = (0, 1, 0)  # nodes 1-2 a branch, node 3 another
    assert tree.reported_len(p, [0, 1, 2]) == 2 and tree.reported_len(p, [0, 3]) == 1  # to a leaf: as a chain fully accepted
    assert tree.reported_len(p, [0, 1]) == 2 and tree.reported_len(p, [0]) == 1  # short of a leaf: a rejection


def test_greedy_verdict_follows_the_models_choices_down_any_branch():
    V = 10
    tokens = (5, 6, 7, 8, 9)  # nodes 1..5: 1 and 2 under the root, 3 under 2, 4 under 3, 5 under 1
    parents_ = (0, 0, 2, 3, 1)
    logits = torch.zeros(6, V)
    for node, best in ((0, 6), (2, 7), (3, 3)):  # root -> 6 (node 2) -> 7 (node 3) -> 3: no such child
        logits[node, best] = 1
    v = tree.accept_greedy(tokens, parents_, logits)
    assert (v.path, v.accepted, v.next, v.emitted, v.reported_len) == ((0, 2, 3), 2, 3, [6, 7, 3], 3)  # node 3 has a child
    assert v.next_ids.tolist() == [3] and v.drafted == tokens


def _tree_rows_equal_chain_rows(dec, prompt: list[int], parents_: tuple[int, ...], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(2, COMMON["vocab_size"], (len(parents_) + 1,), generator=g)
    cfg = GenerationConfig(max_new_tokens=16)
    start = len(prompt)
    prefill(dec, prompt, cfg)
    out, _ = tree_pass.forward_tree(dec, toks, start, parents_)
    for path, _ in tree.segments(parents_):
        prefill(dec, prompt, cfg)  # a fresh cache: the chain of this path alone
        chain = dec.forward(toks[path], start).logits
        for d, node in enumerate(path):
            assert torch.equal(out.logits[node], chain[d]), (parents_, path, node)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_trees_rows_are_its_paths_chain_rows(arch, dtype):
    """Every shape, at a context whose deeper nodes straddle a key-length boundary and at one that does not
    (the sliding-window models' windows are shorter than both)."""
    dec = decoder(arch, dtype)
    exact_or_skip(dec, dtype)
    for context in (exactness.CONTEXT, STRADDLE):
        for i, p in enumerate(SHAPES.values()):
            _tree_rows_equal_chain_rows(dec, prompt_ids(arch, i, context), p, seed=i)


@settings(max_examples=20, deadline=None)
@given(arch=st.sampled_from(sorted(ARCHS)), p=parents(), context=st.integers(20, 70), seed=st.integers(0, 99))
def test_drawn_trees_rows_are_their_paths_chain_rows(arch, p, context, seed):
    _tree_rows_equal_chain_rows(decoder(arch, "float32"), prompt_ids(arch, seed, context), p, seed)


WIDE = {  # head_dim 32: the native step's form, whose tree rows read their paths' keys through a map
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, head_dim=32, attention_bias=True)),
    "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**COMMON, head_dim=32, sliding_window=12)),
}


@functools.cache
def _wide(arch: str) -> Decoder:
    torch.manual_seed(0)
    dec = Decoder(from_hf(WIDE[arch]().to(torch.bfloat16).eval()))
    dec.set_attention(NATIVE)
    return dec


def wide(arch: str) -> Decoder:
    dec = _wide(arch)
    if dec.layers_call(dec.stack) is None:
        pytest.skip("no one-call layers here (no C compiler, no vector instruction set)")
    return dec


@pytest.mark.parametrize("arch", sorted(WIDE))
def test_a_trees_rows_in_one_native_call_are_its_paths_chain_rows(arch):
    """One native call for the whole tree (``native.TreeMap``), at contexts that put the root at several
    places in a 16-key block, across the sliding window: every node's row is its chain row, bit for bit, and
    ``settle`` leaves the cache a chain of the accepted path would."""
    dec = wide(arch)
    cfg = GenerationConfig(max_new_tokens=16)
    for context in (20, 31, 32, 33, 47):
        prompt = prompt_ids(arch, context, context)
        for i, p in enumerate(SHAPES.values()):
            toks = torch.randint(2, COMMON["vocab_size"], (len(p) + 1,), generator=torch.Generator().manual_seed(i))
            prefill(dec, prompt, cfg)
            out, kv = tree_pass.forward_tree(dec, toks, context, p)
            assert kv is None  # the native call ran
            segs = tree.segments(p)
            tree_pass.settle(dec, context, None, tuple(segs[-1][0]))
            settled = [c[:, :, context : context + len(segs[-1][0])].clone() for c in dec.cache.k + dec.cache.v]
            for path, _ in segs:
                prefill(dec, prompt, cfg)
                chain = dec.forward(toks[path], context).logits
                for d, node in enumerate(path):
                    assert torch.equal(out.logits[node], chain[d]), (context, p, path, node)
            assert all(torch.equal(a, c[:, :, context : context + len(path)]) for a, c in
                       zip(settled, dec.cache.k + dec.cache.v)), (context, p)


class Drawn:
    """An Oracle's choices drawn by hypothesis."""

    def __init__(self, data):
        self.data = data

    def parents(self, most: int) -> tuple[int, ...]:
        return self.data.draw(parents(most))

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


class Seeded(Drawn):
    """An Oracle's choices from a seeded generator, where their number depends on timing (a batch's draft
    lengths): hypothesis replays a test's draws, and fails where their number changes."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def parents(self, most: int) -> tuple[int, ...]:
        return tuple(self.integer(0, j - 1) for j in range(1, self.integer(1, most) + 1))

    def integer(self, lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=self.g))


class Oracle:
    """A tree drafter that knows plain decoding's tokens: their next few sit on a drawn branch of a drawn tree,
    every other node a random token, so steps accept down any branch and leave the rest behind."""

    max_len, adaptive, tree, goodput = 11, False, 11, None

    def __init__(self, truth: list[int], n_prompt: int, pick: Drawn):
        self.truth, self.n_prompt, self.pick = truth, n_prompt, pick

    def propose(self, seq, k):
        return Draft.of([], seq.device)

    def propose_tree(self, seq, depth, nodes):
        pick = self.pick
        p = pick.parents(min(depth, nodes))  # no deeper than ``depth``: the positions reserved
        leaf = pick.integer(1, len(p))
        path = [leaf]
        while path[-1]:
            path.append(p[path[-1] - 1])
        done = len(seq.tokens) - self.n_prompt  # plain tokens so far: the node at depth d should be truth[done + d - 1]
        keep = pick.integer(0, len(path) - 1)  # the branch holds the next ``keep`` tokens, then misses
        depth = tree.depths(p)
        toks = [self.truth[done + depth[n] - 1] if n in path and depth[n] <= keep and done + depth[n] <= len(self.truth)
                else pick.integer(2, COMMON["vocab_size"] - 1) for n in range(1, len(p) + 1)]
        return Draft.of(toks, seq.device, p)

    def next_len(self, k, drafted, accepted):
        return k

    def finish(self, seq):
        pass


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@settings(max_examples=12, deadline=None)
@given(arch=st.sampled_from(sorted(ARCHS)), prompt=st.integers(0, 3), data=st.data())
def test_greedy_decoding_with_trees_gives_plain_decodings_tokens(dtype, arch, prompt, data):
    dec = decoder(arch, dtype)
    exact_or_skip(dec, dtype)
    ref = list(plain(arch, dtype, prompt))
    ids = prompt_ids(arch, prompt)
    out, _ = generate(dec, ids, Oracle(ref, len(ids), Drawn(data)), GenerationConfig(max_new_tokens=len(ref)))
    assert out == ref


def test_a_trees_nodes_fit_the_positions_its_sequence_reserved():
    """A pass writes node j's K/V at place start + j, so near the end of its reservation a sequence drafts
    fewer nodes (a packed pass would stop on ``CacheFull``)."""
    dec = wide("llama")
    config = GenerationConfig(max_new_tokens=4)
    seq, logits, _ = prefill(dec, prompt_ids("llama", 1, 60), config)
    run = Run(seq, logits, Suffix(tree=8), config)
    assert run.node_cap() == dec.cache.length - len(seq.tokens) == 3


@settings(max_examples=8, deadline=None)
@given(arch=st.sampled_from(sorted(WIDE)), prompt=st.integers(0, 3), data=st.data())
def test_greedy_decoding_with_trees_in_one_native_call_gives_plain_decodings_tokens(arch, prompt, data):
    dec = wide(arch)
    ids = prompt_ids(arch, prompt, 30)
    config = GenerationConfig(max_new_tokens=24)
    ref = generate(dec, ids, None, config)[0]
    assert generate(dec, ids, Oracle(ref, len(ids), Drawn(data)), config)[0] == ref


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arch", sorted(WIDE))
def test_a_batch_verifies_trees_and_chains_together_and_gives_plain_decodings_tokens(arch, seed):
    """A packed pass of several sequences' trees and chains (``forward_slots`` with ``trees``): oracle trees,
    lookup trees, chains and no draft in one batch, each sequence's tokens its own plain decoding's."""
    dec = wide(arch)
    config = GenerationConfig(max_new_tokens=20)
    ids = [prompt_ids(arch, i, 20 + 7 * i) for i in range(6)]
    refs = [generate(dec, p, None, config)[0] for p in ids]
    kinds = [Oracle(refs[0], len(ids[0]), Seeded(seed)), Oracle(refs[1], len(ids[1]), Seeded(seed + 10)),
             build(DrafterConfig(kind="suffix", tree=6, ngram_sizes=[2, 1]), dec.n_layers),
             build(DrafterConfig(kind="ngram", tree=8, ngram_sizes=[2, 1]), dec.n_layers),
             build(DrafterConfig(kind="ngram", ngram_sizes=[2, 1]), dec.n_layers), None]
    trees = []
    plan = BatchPlan(3, PassCosts((1, 64), (1.0, 1.0)), True, pooled=True)
    with pytest.MonkeyPatch.context() as mp:
        accept = tree.accept_greedy
        mp.setattr(batched.tree, "accept_greedy", lambda *a: trees.append(1) or accept(*a))
        done = list(decode_batch(dec, [PromptJob(p, d, config) for p, d in zip(ids, kinds)], plan))
    assert sorted(f.tokens for f in done) == sorted(refs) and trees


@pytest.mark.parametrize("kind", ["suffix", "ngram"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lookup_trees_give_plain_decodings_tokens(arch, kind):
    dec = decoder(arch, "float32")
    for prompt in range(4):
        ids = prompt_ids(arch, prompt)
        ref = list(plain(arch, "float32", prompt))
        for nodes in (2, 6, 11):
            cfg = DrafterConfig(kind=kind, tree=nodes, ngram_sizes=[2, 1])
            assert generate(dec, ids, build(cfg, dec.n_layers), GenerationConfig(max_new_tokens=len(ref)))[0] == ref


def test_an_ngram_tree_merges_the_continuations_of_its_latest_occurrences():
    from knnssd.engine.spec import suffix
    from knnssd.engine.spec.drafters import NGram

    toks = [1, 2, 3, 9, 1, 2, 4, 1, 2, 3, 7, 1, 2]  # after "1 2": "3 9", "4 1", "3 7"; the latest is "3 7"
    ng = NGram((2, 1), max_len=2)
    assert ng.lookup("s", toks, 2) == [3, 7]
    tokens, parents_ = suffix.select(ng.ranked("s", toks, 2), 5, 2)
    branches = {tuple(tokens[n - 1] for n in path[1:]) for path, _ in tree.segments(parents_)}
    assert branches == {(3, 9), (3, 7), (4, 1)}
    assert suffix.select(ng.ranked("s", toks, 2), 2, 2) == ([3, 7], (0, 1))  # "3" twice, then the latest after it


def test_sampled_runs_and_undrafted_ones_verify_chains():
    dec = decoder("llama", "float32")
    ids = prompt_ids("llama", 1)
    for warp, drafter, trees in ((Warp(), Suffix(tree=4), True), (Warp(temperature=0.7), Suffix(tree=4), False),
                                 (Warp(), Suffix(), False), (Warp(), None, False)):
        config = GenerationConfig(max_new_tokens=4, warp=warp, seed=1)
        seq, logits, _ = prefill(dec, ids, config)
        assert Run(seq, logits, drafter, config).trees is trees


def test_a_suffix_tree_holds_the_chain_and_the_other_continuations():
    index = SequenceIndex()
    index.extend([1, 2, 3, 9, 1, 2, 4, 1, 2, 3, 7, 1, 2])  # after "1 2": "3 9", "4 1", "3 7"
    tokens, parents_ = draft_tree(index, 5, 2)
    tree.check(parents_)
    branches = {tuple(tokens[n - 1] for n in path[1:]) for path, _ in tree.segments(parents_)}
    assert branches == {(3, 9), (3, 7), (4, 1)}
    assert draft_tree(index, 1, 2) == ([3], (0,))  # the most frequent first
    empty = SequenceIndex()
    empty.extend([1, 2, 3])
    assert draft_tree(empty, 4, 8) == ([], ())


def test_tree_settings_are_checked_and_described():
    assert "tree 8" in DrafterConfig(kind="suffix", tree=8).describe()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="tree must be an integer >= 0"):
            DrafterConfig(kind="suffix", tree=bad)
