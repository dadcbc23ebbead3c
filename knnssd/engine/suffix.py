"""Suffix drafting (SuffixDecoding, arXiv 2411.04975), as a compact bounded-depth suffix trie.

Terms:
    D        the trie's depth: every substring of at most D tokens is a path from the root
    count    how many times a node's path occurs; a child's count over its parent's estimates the
             probability of that next token after the path
    match    the longest suffix of the sequence (at most ``MATCH`` tokens) that occurred before and was
             followed by something
    score    a draft's summed token probabilities, as arctic-inference scores one

A ``SuffixIndex`` indexes one token list incrementally (``append``: O(D) a token, over the nodes of the
suffixes ending at the end). Each sequence has one over its prompt and its tokens so far; a
``SuffixCache`` holds one over the outputs of the last ``requests`` finished sequences (evicted oldest
first, their counts taken back), shared by the sequences of a bank. A ``Suffix`` drafter matches the
sequence in both, and from the better match drafts the most frequent continuation, token by token,
while each token's probability stays at ``min_prob`` or more, and for at most ``factor`` times the match
length (a long match earns a long draft; SuffixDecoding's adaptive speculation).

Written here rather than taken from arctic-inference (whose suffix tree vLLM uses): its 0.3.0 ships only
as source, built with CMake and nanobind against torch >= 2.10 and protobuf 5.29.6 in an isolated
build, next to its vLLM plugin.
"""
from __future__ import annotations

from collections import deque

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


def chain(node: _Node, k: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent continuation below ``node``: up to ``k`` tokens while each one's probability (its
    count over its parent's, as SuffixDecoding estimates it) is ``min_prob`` or more; with its score."""
    out, score = [], 0.0
    while len(out) < k and node.children:
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        p = child.count / node.count
        if p < min_prob:
            break
        out.append(token)
        score += p
        node = child
    return out, score


class SuffixCache:
    """The outputs of the last ``requests`` finished sequences in one ``SuffixIndex``."""

    def __init__(self, requests: int = 256, depth: int = DEPTH):
        self.index = SuffixIndex(depth)
        self.requests = requests
        self._held: deque[list[int]] = deque()

    def add(self, output: list[int]) -> None:
        if not output or self.requests < 1:
            return
        self.index.start()
        self.index.extend(output)
        self._held.append(list(output))
        while len(self._held) > self.requests:
            self.index.remove(self._held.popleft())
        self.index.start()

    def __len__(self) -> int:
        return len(self._held)


def propose(own: SuffixIndex, cache: SuffixCache | None, tokens: list[int], k: int, min_prob: float,
            factor: float) -> list[int]:
    """Up to ``k`` tokens: the better-scored chain of the sequence's own match and the cache's. The match does
    not depend on ``k``, so a shorter draft is a prefix of a longer one (the search's simulator relies on it)."""
    best: tuple[list[int], float] = ([], 0.0)
    for index in (own, cache.index if cache is not None else None):
        if index is None:
            continue
        node, m = index.match(tokens, min(MATCH, index.depth - 1))
        if node is None:
            continue
        draft = chain(node, min(k, max(1, int(factor * m))), min_prob)
        if draft[1] > best[1]:
            best = draft
    return best[0]
