"""Token trees: several continuations drafted at once and verified in one full-model pass.

Terms:
    node     a row of the pass: node 0 is the sequence's last token (the root), nodes 1..N the draft
    parents  (N,) host ints: ``parents[j - 1]`` is node j's parent, an earlier node (0: the root)
    depth    a node's distance from the root; it sits at position ``start + depth``, as it would in a chain
    path     the nodes from the root down to one node, in order; a leaf's path is a chain
    segment  the nodes of a leaf's path that no earlier leaf's path holds: a suffix of the path

Exactness (docs/exactness.md): a node's row must be the row its token gets in a chain. The linears are
row-invariant wherever the probe says exact, so they run on all the nodes at once. Attention runs once
per leaf, for its segment only, over the keys its path puts at positions ``start..start + len(path) - 1``:
the keys and order a chain of that path reads, so the probe's guarantee for a chain's rows holds. The
native step reads a path's keys through a map instead, all nodes in one call: each node writes its K/V at
place ``start + node`` and reads its ancestors' from theirs (``native.TreeMap``). After the verdict,
``settle`` puts the accepted path's K/V at its positions; later positions are masked.

Greedy only: under sampling a tree would need a multi-draft rejection scheme to keep the distribution,
so sampled runs verify the chain (``loop.Run``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def check(parents: tuple[int, ...]) -> None:
    """A ValueError unless every node's parent is an earlier node."""
    for j, p in enumerate(parents, start=1):
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < j:
            raise ValueError(f"tree node {j}'s parent must be an earlier node (0..{j - 1}), got {p!r}")


def is_chain(parents: tuple[int, ...]) -> bool:
    """One leaf: the tree is a chain, verified as one by the faster chain pass."""
    return parents == tuple(range(len(parents)))


def depths(parents: tuple[int, ...]) -> list[int]:
    """(N + 1,): each node's depth, the root's 0."""
    out = [0]
    for p in parents:
        out.append(out[p] + 1)
    return out


def paths(parents: tuple[int, ...]) -> list[list[int]]:
    """(N + 1,): each node's path, the root's [0]."""
    out = [[0]]
    for j, p in enumerate(parents, start=1):
        out.append([*out[p], j])
    return out


def moves(path: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
    """(node, depth) for each node of an accepted path not at its own depth's place: where a pass that
    wrote node j's K/V at place ``start + j`` must move them from and to. A node's index is at least its
    depth, so moving in path order never overwrites a place still to be read."""
    return [(node, d) for d, node in enumerate(path) if node != d]


def segments(parents: tuple[int, ...]) -> list[tuple[list[int], int]]:
    """Each leaf's path and where its segment starts in it (nodes before that are on an earlier leaf's path),
    leaves in node order. Every node is in exactly one segment."""
    n = len(parents) + 1
    is_parent = [False] * n
    for p in parents:
        is_parent[p] = True
    done = [False] * n
    out = []
    for leaf in range(n):
        if is_parent[leaf]:
            continue
        path, at = [], leaf
        while True:
            path.append(at)
            if at == 0:
                break
            at = parents[at - 1]
        path.reverse()
        j0 = 0
        while j0 < len(path) and done[path[j0]]:
            j0 += 1
        for node in path[j0:]:
            done[node] = True
        out.append((path, j0))
    return out


@dataclass(frozen=True)
class TreeVerdict:
    """What greedy verification of a tree accepted: ``Verdict``'s fields, and the accepted nodes."""

    accepted: int  # n: the accepted path's drafted nodes
    drafted: tuple[int, ...]  # every drafted node's token (what was verified)
    next: int  # y: the full model's token after the accepted path
    next_ids: torch.Tensor  # (1,): y on the device
    path: tuple[int, ...]  # the accepted nodes, root (0) first
    reported_len: int  # the draft length the adaptive rule is told (``reported_len``)

    @property
    def emitted(self) -> list[int]:
        return [*(self.drafted[j - 1] for j in self.path[1:]), self.next]


def reported_len(parents: tuple[int, ...], path: list[int] | tuple[int, ...]) -> int:
    """The draft length a tree step reports to the adaptive rule (``draft_policy.next_len``): the accepted
    path's where it ends at a leaf (its whole branch accepted: lengthen), else one more (a rejection). Every
    node counted instead, a tree with two leaves would read as a rejection at every step."""
    return len(path) - 1 + (path[-1] in parents)


def walk(tokens: tuple[int, ...] | list[int], parents: tuple[int, ...], choose: Callable[[int, int], int | None]
         ) -> list[int]:
    """The accepted path, root (0) first: from the root, follow the child whose token is ``choose(node,
    depth)``, the token the full model gives after the path so far (a repeated sibling token: the first)."""
    children: dict[tuple[int, int], int] = {}
    for j, (p, t) in enumerate(zip(parents, tokens), start=1):
        children.setdefault((p, t), j)
    path = [0]
    while (path[-1], choose(path[-1], len(path) - 1)) in children:
        path.append(children[(path[-1], choose(path[-1], len(path) - 1))])
    return path


def accepted_path(tokens: list[int], parents: tuple[int, ...], truth: list[int]) -> list[int]:
    """The path greedy verification accepts where the full model's tokens are ``truth`` (the search's
    simulator, on plain decoding's continuation)."""
    return walk(tokens, parents, lambda node, d: truth[d] if d < len(truth) else None)


def accept_greedy(tokens: tuple[int, ...], parents: tuple[int, ...], logits: torch.Tensor) -> TreeVerdict:
    """Greedy verification of a tree: tokens (N,) the drafted nodes' tokens; logits (N + 1, V), one row per
    node. One host read (the argmaxes)."""
    best_dev = logits.argmax(-1)
    best = best_dev.tolist()
    path = walk(tokens, parents, lambda node, d: best[node])
    last = path[-1]
    return TreeVerdict(len(path) - 1, tuple(tokens), best[last], best_dev[last : last + 1], tuple(path),
                       reported_len(parents, path))
