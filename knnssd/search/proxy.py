"""The proxy stage's model of a drafter: teacher-forced traces replayed through the speculative loop.

One teacher-forced pass of a draft (a skip mask and precision) over prompts and their plain AR
continuations gives, per position, whether the draft's top token matches and how confident it
was (``Trace``). ``simulate`` replays the speculative loop on those traces with measured step
costs (``costs.Costs``) and predicts the speedup of a drafting policy (kind, confidence threshold,
max draft length, adaptive or goodput lengths, n-gram sizes, a lookup drafter's tree size); ``best_policy`` tries
them all. The first masks tried skip the least influential sub-layers (``influence``).

Terms: a policy's ``k`` is its max draft length (a tree's depth); its ``tree`` the nodes of a lookup
drafter's token trees (0: chains), each tree pass priced by its measured cost (``Costs.tree_ms``).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from knnssd.engine.spec.loop import GenerationConfig, acceptance_rate, generate, mean_accepted
from knnssd.engine.spec import draft_policy
from knnssd.engine.spec import suffix
from knnssd.engine.model import tree
from knnssd.engine.model.exactness import MAX_T
from knnssd.engine.spec.drafters import DrafterConfig, NGram, Suffix
from knnssd.engine.spec.suffix import SequenceIndex
from knnssd.engine.model.decoder import Decoder
from knnssd.engine.model.skip import SkipMask
from knnssd.search import cancel
from knnssd.search.costs import Costs

THRESHOLDS = (0.0, 0.3, 0.5, 0.7, 0.9)
PROBED = MAX_T - 1  # the longest draft the exactness probe covers (less the step's own row), as ``loop.Run``
MAX_LENS = (2, 3, 4, 6, 8, 10)
TREES = (0, 4, 8, 11)  # a lookup drafter's tree sizes tried (0: chains; 11: the longest pass the probe checks)
TREE_KEY = "trees"  # (TREE_KEY, "suffix" or n-gram sizes): the proposals' entries that hold ``Trees``
NGRAM_SIZES = ((3, 2, 1), (3, 2), (4, 3, 2))


@dataclass
class Trace:
    """One teacher-forced draft pass: per continuation position, top-1 match and its probability."""

    match: np.ndarray  # (n,) bool
    conf: np.ndarray  # (n,) float32


@dataclass
class Sample:
    prompt: list[int]  # full prompt ids (n-gram lookup sees all of it)
    cont: list[int]  # plain AR continuation


def teacher_samples(dec, tokenizer, texts: list[str], max_new_tokens: int, eos: tuple[int, ...]) -> list[Sample]:
    """Each text's prompt ids and plain AR continuation (the sequences every trace teacher-forces)."""
    out = []
    for text in texts:
        cancel.check()
        ids = tokenizer(text).input_ids
        cont, _ = generate(dec, ids, None, GenerationConfig(max_new_tokens=max_new_tokens, eos_ids=eos))
        out.append(Sample(ids, cont))
    return out


@torch.inference_mode()
def trace(dec: Decoder, samples: list[Sample], mask: SkipMask, int8: bool, context: int) -> list[Trace]:
    stack = dec.int8_stack() if int8 else None
    out = []
    for s in samples:
        ctx = s.prompt[-context:]
        ids = torch.tensor(ctx + s.cont, dtype=torch.long, device=dec.stack.device)
        logits = dec.forward(ids, 0, mask, stack).logits[len(ctx) - 1 : -1]
        p = logits.softmax(-1)
        conf, top = p.max(-1)
        out.append(Trace((top.cpu() == torch.tensor(s.cont)).numpy(), conf.cpu().numpy()))
    return out


@dataclass(frozen=True)
class Policy:
    kind: str  # "layer_skip" | "hybrid" | "ngram" | "suffix"
    max_len: int
    threshold: float = 0.0
    adaptive: bool = False
    ngram_sizes: tuple[int, ...] = (3, 2, 1)
    tree: int = 0  # ngram, suffix: nodes of their token trees (0: chains)
    goodput: bool = False  # ngram, suffix: each draft cut to what pays (``draft_policy.Goodput``)


def ngram_proposals(sample: Sample, sizes: tuple[int, ...], max_len: int) -> list[list[int]]:
    """proposal[j] = what NGram would propose after prompt + cont[:j] (for j = 1..n-1)."""
    ng = NGram(sizes, max_len)
    key = object()
    return [[]] + [ng.lookup(key, sample.prompt + sample.cont[:j], max_len) for j in range(1, len(sample.cont))]


def suffix_proposals(sample: Sample, max_len: int) -> list[list[int]]:
    """proposal[j] = what the suffix drafter (its defaults, no cache) would propose after prompt + cont[:j]
    (for j = 1..n-1), its index grown token by token as the drafter's is; a shorter draft is a prefix."""
    d, index = Suffix(max_len), SequenceIndex()
    index.extend(sample.prompt)
    out: list[list[int]] = [[]]
    for j in range(1, len(sample.cont)):
        index.extend(sample.cont[j - 1 : j])
        out.append(d.lookup(index, max_len))
    return out


class Trees:
    """A lookup drafter's token trees at every position of every sample, as the drafter makes them after
    prompt + cont[:j]: the continuations ranked once to ``depth`` (``suffix.ranked``, ``NGram.ranked``; on
    demand, as the policies visit few positions), a tree of any budget and shallower depth selected from
    them (``suffix.select``); both memoized, as the policies revisit the same positions."""

    def __init__(self, samples: list[Sample], depth: int, ngram_sizes: tuple[int, ...] | None = None):
        self.samples, self.depth = samples, depth
        self._ngram = [NGram(ngram_sizes, depth) for _ in samples] if ngram_sizes is not None else None
        self._ranked: dict[tuple[int, int], suffix.Ranked] = {}
        self._memo: dict[tuple[int, int, int, int], tuple[list[int], tuple[int, ...]]] = {}

    def _ranked_at(self, si: int, j: int) -> suffix.Ranked:
        if (si, j) not in self._ranked:
            s = self.samples[si]
            toks = s.prompt + s.cont[:j]
            if self._ngram is not None:
                self._ranked[(si, j)] = self._ngram[si].ranked(si, toks, self.depth)
            else:
                index = SequenceIndex()
                index.extend(toks)
                self._ranked[(si, j)] = suffix.ranked(index, self.depth)
        return self._ranked[(si, j)]

    def at(self, si: int, j: int, budget: int, depth: int) -> tuple[list[int], tuple[int, ...]]:
        key = (si, j, budget, depth)
        if key not in self._memo:
            self._memo[key] = suffix.select(self._ranked_at(si, j), budget, depth)
        return self._memo[key]


def trees_for(policy: Policy, proposals_by_sizes: dict) -> Trees | None:
    """The trees ``policy`` drafts (None where they were not made)."""
    return proposals_by_sizes.get((TREE_KEY, "suffix" if policy.kind == "suffix" else policy.ngram_sizes))


PROPOSING = ("ngram", "hybrid", "suffix")  # the kinds whose drafts come from ``proposals`` (no forward pass)
LOOKUPS = ("ngram", "suffix")  # those that draft by lookup alone


def simulate(samples: list[Sample], traces: list[Trace] | None, policy: Policy, costs: Costs, draft_ms: float,
             proposals: list[list[list[int]]] | None, trees: Trees | None = None) -> tuple[float, float, float]:
    """Replay the speculative loop on teacher-forced traces, with ``draft_policy``'s rules as ``loop.Run``
    and the drafters apply them: (predicted decode speedup, acceptance, mean accepted). ``trees``: the
    lookup drafter's, for a policy with ``tree`` > 0 (the suffix drafter's chain where it has none)."""
    spec_t = ar_t = 0.0
    drafted = accepted = steps = 0
    priced = draft_policy.Goodput() if policy.goodput else None  # one per drafter, as ``drafters.build`` makes
    for si, s in enumerate(samples):
        n = len(s.cont)
        j, k = 1, policy.max_len  # cont[0] comes from the prefill in both AR and speculative decoding
        last = None  # the goodput rule's: how the last draft on offer fared
        while j < n:
            prop = proposals[si][j] if proposals is not None and policy.kind in PROPOSING else []
            kk = draft_policy.cap(k, n - j, PROBED)
            nodes, parents = trees.at(si, j, min(policy.tree, PROBED), kk) if policy.tree and kk > 0 else ([], ())
            if nodes and tree.is_chain(parents):
                prop, nodes = nodes, []  # verified as a chain (``drafters.Draft.of``)
            if nodes:  # a tree step: what the step drafted, accepted, cost, and told the adaptive rule
                path = tree.accepted_path(nodes, parents, s.cont[j:])
                a, n_drafted, reported = len(path) - 1, len(nodes), tree.reported_len(parents, path)
                step_ms = costs.tree_ms(len(nodes) + 1, len(tree.segments(parents)))
            else:
                d_tokens: list[bool] = []
                cost = 0.0
                offer = None
                if kk > 0 and draft_policy.hybrid_uses_ngram(prop):
                    prop = prop[:kk]
                    if priced is not None:  # as ``loop.Run.priced``
                        state = draft_policy.goodput_state(len(prop), last)
                        offer = state, prop, priced.length(state, len(prop), costs.verify_ms)
                        prop = prop[: offer[2]]
                    d_tokens = [prop[i] == s.cont[j + i] for i in range(len(prop))]
                elif policy.kind not in LOOKUPS and kk > 0:
                    tr = traces[si]
                    kept = draft_policy.confident(tr.conf[j : j + kk], policy.threshold)
                    d_tokens = [bool(x) for x in tr.match[j : j + kept]]
                    cost = draft_ms * len(d_tokens)
                a = 0
                while a < len(d_tokens) and d_tokens[a]:
                    a += 1
                if priced is not None and offer is not None:
                    emitted = s.cont[j : j + a + 1]
                    priced.observe(*offer, emitted)
                    last = draft_policy.verified(offer[1], offer[2], emitted)
                n_drafted = reported = len(d_tokens)  # as ``sampling.Verdict.reported_len``
                step_ms = cost + costs.verify_ms(len(d_tokens) + 1)
            spec_t += step_ms
            ar_t += min(a + 1, n - j) * costs.verify_ms(1)
            drafted += n_drafted
            accepted += a
            steps += 1
            k = draft_policy.next_len(k, policy.max_len, policy.adaptive, reported, a)
            j += a + 1
    speedup = ar_t / spec_t if spec_t else 1.0
    return speedup, acceptance_rate(accepted, drafted), mean_accepted(accepted, steps)


def proposals_for(policy: Policy, proposals_by_sizes: dict) -> list | None:
    """The lookup proposals ``policy`` drafts from: the suffix drafter's, or the n-gram sizes' it looks up
    (None where they were not made)."""
    return proposals_by_sizes.get("suffix" if policy.kind == "suffix" else policy.ngram_sizes)


def best_policy(samples, traces, costs, draft_ms, proposals_by_sizes, kinds) -> tuple[Policy, tuple[float, float, float]]:
    best, best_res = None, (0.0, 0.0, 0.0)
    for kind in kinds:
        sizes_opts = NGRAM_SIZES if kind in ("ngram", "hybrid") else (NGRAM_SIZES[0],)
        thr_opts = THRESHOLDS if kind not in LOOKUPS else (0.0,)
        for sizes, thr, k, adaptive, nodes, priced in itertools.product(sizes_opts, thr_opts, MAX_LENS, (False, True),
                                                                        TREES, (False, True)):
            pol = Policy(kind, k, thr, adaptive, sizes, nodes, priced)
            trees = trees_for(pol, proposals_by_sizes)
            if nodes and (kind not in LOOKUPS or trees is None or not costs.tree):
                continue  # trees are the lookups', where their pass was measured
            if priced and (kind not in LOOKUPS or adaptive or nodes):
                continue  # goodput cuts the lookups' chains, in place of the adaptive rule
            res = simulate(samples, traces, pol, costs, draft_ms, proposals_for(pol, proposals_by_sizes), trees)
            if res[0] > best_res[0]:
                best, best_res = pol, res
    return best, best_res


def to_config(policy: Policy, mask: SkipMask | None, int8: bool) -> DrafterConfig:
    if policy.kind == "ngram":
        return DrafterConfig(kind="ngram", max_len=policy.max_len, adaptive=policy.adaptive,
                             ngram_sizes=list(policy.ngram_sizes), tree=policy.tree, goodput=policy.goodput)
    if policy.kind == "suffix":
        return DrafterConfig(kind="suffix", max_len=policy.max_len, adaptive=policy.adaptive, tree=policy.tree,
                             goodput=policy.goodput)
    return DrafterConfig(kind=policy.kind, mask=mask.to_dict(), max_len=policy.max_len, threshold=policy.threshold,
                         int8=int8, ngram_sizes=list(policy.ngram_sizes), adaptive=policy.adaptive)


FREE = 1e-4  # a sub-layer whose update is this small next to the residual stream changes (almost) nothing


@torch.inference_mode()
def influence(dec: Decoder, samples: list["Sample"], context: int) -> torch.Tensor:
    """(2, L): each attention (row 0) and MLP (row 1) sub-layer's update relative to the residual stream,
    averaged over teacher-forced passes of the samples (``Decoder.forward(influence=True)``)."""
    total = torch.zeros(2, dec.n_layers)
    for s in samples:
        ids = torch.tensor(s.prompt[-context:] + s.cont, dtype=torch.long, device=dec.device)
        total += dec.forward(ids, 0, influence=True).influence
    return total / max(1, len(samples))


def least_influential(sizes: torch.Tensor, count: int) -> SkipMask:
    """The mask that skips the ``count`` sub-layers with the smallest ``influence`` (ties: attention first,
    then by layer)."""
    n = sizes.shape[1]
    order = sizes.flatten().argsort(stable=True).tolist()[:count]  # j < n: attention of layer j; else MLP of j - n
    return SkipMask.from_layers(n, attn=[j for j in order if j < n], mlp=[j - n for j in order if j >= n])


def influence_masks(sizes: torch.Tensor) -> list[SkipMask]:
    """The search's first masks: skip the least influential sub-layers, first all the (near) free ones
    (update < ``FREE``), then the smallest eighth and quarter of them."""
    n = sizes.shape[1]
    counts = list(dict.fromkeys(c for c in (int((sizes < FREE).sum()), 2 * n // 8, 2 * n // 4) if c))
    return [least_influential(sizes, c) for c in counts]
