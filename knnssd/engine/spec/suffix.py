"""Suffix drafting (SuffixDecoding, arXiv 2411.04975), as a compact bounded-depth suffix trie.

Terms:
    D        the trie's depth: every substring of at most D tokens is a path from the root
    count    how many times a node's path occurs; a child's count over its parent's estimates the
             probability of that next token after the path
    match    the longest suffix of the sequence (at most ``MATCH`` tokens) that occurred before and was
             followed by something

A ``SuffixIndex`` indexes token lists incrementally (``append``: O(D) a token, over the nodes of the
suffixes ending at the end). A ``SuffixCache`` holds one over the outputs of the last ``requests``
finished sequences (evicted oldest first, their counts taken back), shared by the sequences of a bank.
A sequence's own prompt and tokens go into a ``SequenceIndex`` instead, which drafts what a trie of
them would, from the positions of each token. A ``Suffix`` drafter matches the sequence in its own
tokens, or where they have no match, in the cache, and drafts the most frequent continuation, token by
token, while each token's probability stays at ``min_prob`` or more, and for at most ``factor`` times the
match length (a long match earns a long draft; SuffixDecoding's adaptive speculation).

Written here rather than taken from arctic-inference (whose suffix tree vLLM uses): its 0.3.0 ships only
as source, built with CMake and nanobind against torch >= 2.10 and protobuf 5.29.6 in an isolated
build, next to its vLLM plugin.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

OCCURRENCES = 16  # a token tree merges the continuations of at most this many earlier occurrences
DEPTH = 24  # the trie's depth: a match and the draft below it (SuffixDecoding's default max_tree_depth is 24)
MATCH = 12  # the longest context matched, leaving room below it for a draft of DEPTH - MATCH tokens


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixIndex:
    """Every substring of at most ``depth`` tokens of one or more token lists, with its count."""

    def __init__(self, depth: int = DEPTH):
        self.depth, self.root = depth, _Node()
        self._tail: list[_Node] = []  # the nodes of the suffixes ending at the last appended token, shortest first

    def start(self) -> None:
        """Begin a new token list: no substring crosses from the last one into the next."""
        self._tail = []

    def append(self, token: int) -> None:
        tail = [self.root, *self._tail[: self.depth - 1]]
        self._tail = []
        for node in tail:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
            child.count += 1
            self._tail.append(child)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)

    def remove(self, tokens: list[int]) -> None:
        """Take back one earlier ``start`` + ``extend(tokens)``: counts down, empty nodes dropped."""
        for i in range(len(tokens)):
            node, path = self.root, []
            for t in tokens[i : i + self.depth]:
                node = node.children[t]
                path.append((node, t))
            parent = self.root
            for node, t in path:
                node.count -= 1
                if node.count == 0:
                    del parent.children[t]
                    break
                parent = node

    def node(self, context: list[int]) -> _Node | None:
        node = self.root
        for t in context:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def match(self, tokens: list[int], longest: int) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``tokens``, of at most ``longest`` tokens, that has a continuation
        here, and its length; (None, 0) if none. The suffixes of this index's own list all occur (the
        current occurrence, with no continuation yet), so a match is one with children."""
        for m in range(min(longest, len(tokens)), 0, -1):
            node = self.node(tokens[-m:])
            if node is not None and node.children:
                return node, m
        return None, 0


def chain(node: _Node, k: int, min_prob: float) -> list[int]:
    """The most frequent continuation below ``node``: up to ``k`` tokens while each one's probability (its
    count over its parent's, as SuffixDecoding estimates it) is ``min_prob`` or more."""
    out = []
    while len(out) < k and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        p = child.count / node.count
        if p < min_prob:
            break
        out.append(token)
        node = child
    return out


class SuffixCache:
    """The outputs of the last ``requests`` finished sequences in one ``SuffixIndex``, and of no more than
    ``tokens`` tokens together (the oldest go first): a trie node is a Python object, about 3 KB of them a
    token at depth 24, so the budget bounds its memory (16,384 tokens: about 50 MB)."""

    def __init__(self, requests: int = 256, tokens: int = 16384, depth: int = DEPTH):
        self.index = SuffixIndex(depth)
        self.requests, self.tokens = requests, tokens
        self._held: deque[list[int]] = deque()
        self._size = 0

    def add(self, output: list[int]) -> None:
        if not output or self.requests < 1 or len(output) > self.tokens:
            return
        self.index.start()
        self.index.extend(output)
        self._held.append(list(output))
        self._size += len(output)
        while len(self._held) > self.requests or self._size > self.tokens:
            old = self._held.popleft()
            self.index.remove(old)
            self._size -= len(old)
        self.index.start()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        """Forget every output (a bench's next pass must not find its own prompts' outputs of the last)."""
        self.index = SuffixIndex(self.index.depth)
        self._held.clear()
        self._size = 0


def draft_length(k: int, m: int, factor: float) -> int:
    """A draft after a match of ``m`` tokens: at most ``factor`` times ``m`` (at least 1), and ``k``."""
    return min(k, max(1, int(factor * m)))


class SequenceIndex:
    """One sequence's tokens, indexed by position: what a ``SuffixIndex`` of them would draft (the same match,
    counts and chain, ``test_suffix`` checks it), at one list append a token instead of ``depth`` trie nodes.
    A prompt of 900 tokens took tens of milliseconds to put into a trie. Matches are found from the earlier
    positions of the last token, each extended backwards."""

    def __init__(self, depth: int = DEPTH):
        self.depth = depth
        self.tokens: list[int] = []
        self._at: dict[int, list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self._at.setdefault(t, []).append(len(self.tokens))
            self.tokens.append(t)

    def matches(self) -> dict[int, int]:
        """Every earlier position q of the last token -> its match: how many tokens up to q equal the
        sequence's last ones (at most ``MATCH``, and below the depth)."""
        toks, n = self.tokens, len(self.tokens)
        if n < 2:
            return {}
        longest = min(MATCH, self.depth - 1)
        length = {}
        for q in self._at[toks[-1]]:
            if q >= n - 1:
                break
            m = 1
            while m < longest and q - m >= 0 and toks[q - m] == toks[n - 1 - m]:
                m += 1
            length[q] = m
        return length

    def draft(self, k: int, min_prob: float, factor: float) -> list[int]:
        """The chain after the longest earlier match (``chain``'s rule)."""
        toks, n = self.tokens, len(self.tokens)
        length = self.matches()
        m = max(length.values(), default=0)
        if m == 0:
            return []
        occ = [q for q, lq in length.items() if lq >= m] + [n - 1]  # every occurrence of the match, in order
        out: list[int] = []
        for _ in range(min(draft_length(k, m, factor), self.depth - m)):
            counts: dict[int, int] = {}
            for q in occ:
                if q + 1 < n:
                    counts[toks[q + 1]] = counts.get(toks[q + 1], 0) + 1
            if not counts:
                break
            token, c = max(counts.items(), key=lambda kv: kv[1])
            p = c / len(occ)
            if p < min_prob:
                break
            out.append(token)
            occ = [q + 1 for q in occ if q + 1 < n and toks[q + 1] == token]
        return out


class Ranked(NamedTuple):
    """The nodes of a token tree's candidates, best first (``ranked``): node ids count from 1 in the order
    they were made, so a parent's id is below its children's."""

    node: list[int]
    parent: list[int]  # 0: the root
    token: list[int]
    depth: list[int]


def ranked(own: SequenceIndex, depth: int) -> Ranked:
    """Below the ``OCCURRENCES`` earlier occurrences of the sequence's last token with the longest matches
    (the latest among equals), their continuations of at most ``depth`` tokens, merged where they agree,
    best first (``ranked_from``). Uncapped, a common token's thousand occurrences cost a draft 20 ms."""
    best = sorted(own.matches().items(), key=lambda qm: (-qm[1], -qm[0]))[:OCCURRENCES]
    return ranked_from(own.tokens, dict(best), depth)


def ranked_from(toks: list[int], matches: dict[int, int], depth: int) -> Ranked:
    """The continuations of ``toks`` after each position q of ``matches`` (q -> the length of its match),
    at most ``depth`` tokens each, merged where they agree, best first: a node ranks by the longest match
    among the occurrences through it, then by how many of those share that match (SuffixDecoding's
    frequency), then by how many pass through it, then by the order ``matches`` gives the occurrences, so it
    never ranks below a child. A node's rank does not depend on ``depth``."""
    trie: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    parent_of, token_of, depth_of, ms = [0], [0], [0], [[]]
    for q, m in matches.items():
        parent = 0
        for t in toks[q + 1 : q + 1 + depth]:
            node = trie.get((parent, t))
            if node is None:
                node = trie[(parent, t)] = len(token_of)
                parent_of.append(parent)
                token_of.append(t)
                depth_of.append(depth_of[parent] + 1)
                ms.append([])
            ms[node].append(m)
            parent = node

    def rank(node: int) -> tuple:
        best = max(ms[node])
        return -best, -ms[node].count(best), -len(ms[node]), node

    order = sorted(range(1, len(token_of)), key=rank)
    return Ranked(order, [parent_of[n] for n in order], [token_of[n] for n in order], [depth_of[n] for n in order])


def select(r: Ranked, budget: int, depth: int) -> tuple[list[int], tuple[int, ...]]:
    """The ``budget`` best nodes at most ``depth`` deep, as a tree (``tree.py``): their tokens and parents
    (0: the root), parents first. What ``ranked(own, depth)`` would give, from a ranking to any greater
    depth (the search's simulator ranks once per position)."""
    kept = [(n, p, t) for n, p, t, d in zip(r.node, r.parent, r.token, r.depth) if d <= depth][:budget]
    kept.sort()
    new = {n: j for j, (n, _, _) in enumerate(kept, start=1)}
    return [t for _, _, t in kept], tuple(new[p] if p else 0 for _, p, _ in kept)


def draft_tree(own: SequenceIndex, budget: int, depth: int) -> tuple[list[int], tuple[int, ...]]:
    """A token tree of at most ``budget`` nodes, each at most ``depth`` deep, of the sequence's own earlier
    continuations (``ranked``, ``select``); ([], ()) where the sequence has no earlier match."""
    return select(ranked(own, depth), budget, depth)


def propose(own: SequenceIndex, cache: SuffixCache | None, k: int, min_prob: float, factor: float) -> list[int]:
    """Up to ``k`` tokens: the chain after the sequence's own match, or where it has none, after the cache's.
    (SuffixDecoding takes the better-scored of the two; replayed on SmolLM2's outputs, the cache only as a
    fallback was accepted longer in five domains of six: docs/benchmarks.md.) The match does not depend on
    ``k``, so a shorter draft is a prefix of a longer one (the search's simulator relies on it)."""
    out = own.draft(k, min_prob, factor)
    if out or cache is None:
        return out
    node, m = cache.index.match(own.tokens, min(MATCH, cache.index.depth - 1))
    return chain(node, draft_length(k, m, factor), min_prob) if node is not None else []
