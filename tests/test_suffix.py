"""The suffix drafter (``engine/spec/suffix.py``): its trie against brute-force counts, its cache's eviction, and
greedy decoding with it equal to plain decoding on tiny random models."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from knnssd.engine.spec.loop import GenerationConfig, generate
from knnssd.engine.model.build import make_decoder
from knnssd.engine.spec.drafters import DrafterConfig, Suffix, build
from knnssd.engine.spec.suffix import MATCH, SequenceIndex, SuffixCache, SuffixIndex, chain, draft_length, propose
from tiny import hf_greedy, prompt_ids, tiny

tokens = st.lists(st.integers(0, 4), min_size=0, max_size=40)


def _counts(lists: list[list[int]], depth: int) -> Counter:
    c = Counter()
    for toks in lists:
        for i in range(len(toks)):
            for j in range(i + 1, min(len(toks), i + depth) + 1):
                c[tuple(toks[i:j])] += 1
    return c


def _walk(index: SuffixIndex) -> Counter:
    out, stack = Counter(), [((), index.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.children.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


@given(st.lists(tokens, max_size=4), st.integers(1, 6))
def test_the_trie_counts_every_substring_and_takes_lists_back(lists, depth):
    index = SuffixIndex(depth)
    for toks in lists:
        index.start()
        index.extend(toks)
    assert _walk(index) == _counts(lists, depth)
    for toks in lists[:1]:
        index.remove(toks)
    assert _walk(index) == _counts(lists[1:], depth)


def _own(toks: list[int], depth: int = 8) -> SequenceIndex:
    index = SequenceIndex(depth)
    index.extend(toks)
    return index


def test_a_draft_continues_the_most_frequent_earlier_match():
    index = SuffixIndex(8)
    toks = [5, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2]
    index.extend(toks)
    node, m = index.match(toks, 6)
    assert m == 2  # of the suffixes, only [1, 2] occurred before with a continuation
    assert chain(node, 4, 0.0)[0] == 3  # after [1, 2]: 3 twice, 4 once
    assert propose(_own(toks), None, 4, 0.0, 1.0) == [3, 9]  # at most factor x match length tokens
    assert propose(_own(toks), None, 4, 0.0, 3.0) == [3, 9, 1, 2]
    assert propose(_own(toks), None, 4, 0.9, 3.0) == []  # 3 has probability 2/4 there
    assert propose(_own([1, 2]), None, 4, 0.0, 1.0) == []


@given(st.lists(st.integers(0, 3), max_size=60), st.integers(1, 8), st.sampled_from([0.0, 0.3]),
       st.sampled_from([1.0, 4.0]), st.sampled_from([8, 24]))
def test_the_sequence_index_drafts_what_a_trie_of_the_sequence_would(toks, k, min_prob, factor, depth):
    trie = SuffixIndex(depth)
    trie.extend(toks)
    node, m = trie.match(toks, min(MATCH, depth - 1))
    want = chain(node, draft_length(k, m, factor), min_prob) if node is not None else []
    assert _own(toks, depth).draft(k, min_prob, factor) == want


def test_the_cache_keeps_the_last_outputs_and_drafts_from_them():
    cache = SuffixCache(requests=2, depth=8)
    for out in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9]):
        cache.add(out)
    assert len(cache) == 2 and cache.index.node([1]) is None and cache.index.node([5, 6, 7]).count == 1
    assert propose(_own([0, 5, 6]), cache, 4, 0.0, 2.0) == [7, 8]
    small = SuffixCache(requests=10, tokens=6, depth=8)  # and by tokens: the oldest go first
    for out in ([1, 2, 3], [4, 5, 6], [7, 8], list(range(10, 20))):
        small.add(out)
    assert len(small) == 2 and small.index.node([1]) is None and small.index.node([4, 5]).count == 1
    cache.clear()  # a bench's next pass: nothing of the last one's outputs
    assert len(cache) == 0 and propose(_own([0, 5, 6]), cache, 4, 0.0, 2.0) == []
    cache.add([5, 6, 7, 8])
    assert propose(_own([0, 5, 6]), cache, 4, 0.0, 2.0) == [7, 8]


def test_suffix_settings_are_checked():
    with pytest.raises(ValueError, match="suffix_min_prob"):
        DrafterConfig(kind="suffix", suffix_min_prob=1.5)
    with pytest.raises(ValueError, match="suffix_factor"):
        DrafterConfig(kind="suffix", suffix_factor=float("nan"))
    cfg = DrafterConfig(kind="suffix", max_len=6, suffix_min_prob=0.2, suffix_factor=2.0)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.describe() == "suffix k<=6 p>=0.2 x2"
    assert DrafterConfig(kind="suffix").describe() == "suffix k<=8 p>=0.1 x4"
    d = build(cfg, 4, cache=SuffixCache())
    assert isinstance(d, Suffix) and d.cache is not None


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_suffix_drafting_gives_plain_decodings_tokens(arch):
    """Every prompt twice, with one cache: the second time the cache holds its first output."""
    dec = make_decoder(tiny(arch))
    cache = SuffixCache()
    config = GenerationConfig(max_new_tokens=24)
    accepted = []
    for i in (0, 1, 0, 1):
        new, stats = generate(dec, prompt_ids(arch, i), build(DrafterConfig(kind="suffix"), 4, cache=cache), config)
        assert tuple(new) == hf_greedy(arch, i, 24)
        accepted.append(stats.mean_accepted)
    assert len(cache) == 4
    assert accepted[2] > accepted[0] and accepted[2] > 2  # the repeat drafts from its own earlier output


def test_the_drafter_indexes_a_sequence_incrementally():
    d = Suffix(max_len=4, min_prob=0.0, factor=1.0)

    class Seq:  # the fields ``propose`` reads
        uid, tokens, device, n_prompt = 7, [1, 2, 3, 1, 2], torch.device("cpu"), 5

    seq = Seq()
    assert d.propose(seq, 4).tokens.tolist() == [3, 1]
    seq.tokens += [3, 1, 2]  # accepted tokens: the index grows by these only
    assert d.propose(seq, 4).tokens.tolist() == [3, 1, 2]
    assert len(d._index.tokens) == 8


def test_complete_offers_every_drafter_kind():
    from knnssd.cli import parser
    from knnssd.engine.spec.drafters import KINDS

    complete = next(a for a in parser()._subparsers._group_actions[0].choices["complete"]._actions
                    if a.dest == "drafter")
    assert tuple(complete.choices) == KINDS
