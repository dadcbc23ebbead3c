"""Zero-training drafters behind one small interface.

A drafter proposes up to ``k`` next tokens for a ``Sequence`` (the tokens so far and the
decoder with its KV cache); the full model then verifies them in one pass (``loop.py``).

    LayerSkip  the model itself with some sub-layers skipped (a ``SkipMask``), optionally on
               int8 copies of its weights; stops early when its confidence drops below a threshold
    NGram      prompt lookup: continue the latest earlier occurrence of the last n tokens (prompt
               + generated text), trying the longest n first; costs no forward pass; optionally a
               token tree of the continuations of its latest occurrences (``tree.py``)
    Hybrid     NGram when it finds a match, LayerSkip otherwise
    Suffix     SuffixDecoding: the most frequent continuation of the longest earlier match, in the
               sequence or in a cache of earlier outputs shared by a bank's sequences (``suffix.py``);
               optionally a token tree of the sequence's own continuations (``tree.py``)

``DrafterConfig`` is the serialisable description (what the search tunes and banks store);
``build`` turns it into a drafter for a given decoder.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from knnssd.engine.spec import draft_policy
from knnssd.engine.spec import suffix
from knnssd.engine.model import tree
from knnssd.engine.spec.sampling import draw, probs
from knnssd.engine.spec.sequence import Sequence
from knnssd.engine.model.skip import MaskError, SkipMask

KINDS = ("none", "layer_skip", "ngram", "hybrid", "suffix")
SKIPPING = ("layer_skip", "hybrid")  # the kinds that run a skip mask (the others ignore one)


@dataclass
class Draft:
    tokens: torch.Tensor  # (k,) long, on the model's device
    q: torch.Tensor | None = None  # (k, V) draft distributions when sampling; None = point masses
    kept: torch.Tensor | None = None  # 0-d: verify only the first ``kept`` (a confidence cut on the device)
    parents: tuple[int, ...] | None = None  # a token tree's (``tree.py``); None: a chain
    host: tuple[int, ...] | None = None  # a tree's tokens on the host, for its verdict's walk

    @classmethod
    def of(cls, tokens: list[int], device: torch.device, parents: tuple[int, ...] | None = None) -> "Draft":
        """From tokens on the host (n-gram lookup): on CUDA through pinned memory, a copy that does not wait
        for the drafts other sequences have queued. With ``parents``, a token tree (a chain where it has
        one leaf: ``tree.is_chain``)."""
        t = torch.tensor(tokens, dtype=torch.long)
        if device.type == "cuda":
            t = t.pin_memory()
        if parents is not None and tree.is_chain(parents):
            parents = None  # verified as a chain, by the faster chain pass
        return cls(t.to(device, non_blocking=True), parents=parents,
                   host=tuple(tokens) if parents is not None else None)

    def __len__(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    """What the decode loop asks of a drafter."""

    max_len: int  # most tokens per draft
    adaptive: bool  # shorten/lengthen drafts after rejections/full acceptances
    goodput: draft_policy.Goodput | None  # a lookup drafter's: keep the part of each draft that pays (None: all)
    tree: int  # the node budget of its token trees (``NGram``, ``Suffix``); 0: it drafts chains only

    def propose(self, seq: "Sequence", k: int) -> Draft: ...

    def propose_tree(self, seq: "Sequence", depth: int, nodes: int) -> Draft:
        """A token tree of at most ``min(tree, nodes)`` nodes, each at most ``depth`` deep (asked only where
        ``tree`` > 0)."""

    def next_len(self, k: int, drafted: int, accepted: int) -> int: ...

    def finish(self, seq: "Sequence") -> None: ...


class _Feedback:
    """The draft-length feedback every drafter shares (``draft_policy.next_len``, as the search's simulator)."""

    max_len: int
    adaptive = False
    goodput: draft_policy.Goodput | None = None
    tree = 0  # chains only, unless a lookup drafter sets a node budget

    def next_len(self, k: int, drafted: int, accepted: int) -> int:
        """The next draft length after a step that drafted ``drafted`` tokens and accepted ``accepted``."""
        return draft_policy.next_len(k, self.max_len, self.adaptive, drafted, accepted)

    def finish(self, seq: "Sequence") -> None:
        """The sequence has ended (a drafter that learns from finished outputs keeps them)."""


class LayerSkip(_Feedback):
    """Drafts with the model itself, some sub-layers skipped (optionally on int8 weights), and stops at the
    first token whose probability is under ``threshold``. ``early_stop`` says where that stop is made: True
    reads each token on the host and drafts no further (free on a CPU, where it saves draft steps); False
    drafts all k tokens with no host read and cuts the draft on the device (``Draft.kept``), so a step
    costs one host sync (the verdict's); None: True on a CPU, False elsewhere. Greedy drafts verify the
    same tokens either way; when sampling, the device draft draws for all k tokens (the same distribution,
    other draws). Off the CPU a threshold saves no draft step and no verified row (the pass has k + 1
    rows either way): it only limits what may be accepted."""

    def __init__(self, mask: SkipMask, max_len: int = 8, threshold: float = 0.0, int8: bool = False,
                 early_stop: bool | None = None):
        self.mask, self.max_len, self.threshold, self.int8 = mask, max_len, threshold, int8
        self.early_stop = early_stop
        self._stack = None

    def propose(self, seq: "Sequence", k: int) -> Draft:
        dec = seq.decoder
        if self.int8 and self._stack is None:
            self._stack = dec.int8_stack()
        early = self.early_stop if self.early_stop is not None else seq.device.type == "cpu"
        pos = len(seq.tokens) - 1
        tok = seq.last  # (1,) on the device
        toks: list[torch.Tensor] = []
        confs: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        for i in range(k):
            logits = dec.forward(tok, pos + i, self.mask, stack=self._stack, last=True).logits[0]
            if seq.warp.greedy:
                tok = logits.argmax(-1, keepdim=True)
                dist = logits.softmax(-1) if self.threshold > 0 else None
            else:
                dist = probs(logits, seq.warp)
                tok = draw(dist, seq.generator).view(1)
                qs.append(dist)
            toks.append(tok)
            if self.threshold > 0:
                confs.append(dist.gather(0, tok))
                if early and bool(draft_policy.stops(confs[-1], self.threshold)):  # as the device cut
                    break
        kept = None
        if confs and not early:  # ``draft_policy.confident``, on the device
            below = draft_policy.stops(torch.cat(confs), self.threshold)
            kept = torch.where(below.any(), below.long().argmax() + 1, len(toks))
        return Draft(torch.cat(toks) if toks else seq.last[:0], torch.stack(qs) if qs else None, kept)


class NGram(_Feedback):
    """Prompt lookup with an incremental index: n-gram -> the positions after its occurrences. A chain
    continues the latest; with ``tree`` > 0, ``propose_tree`` merges the continuations of the latest
    ``suffix.OCCURRENCES`` into a token tree of at most ``tree`` nodes, the most frequent first
    (``suffix.ranked_from``)."""

    def __init__(self, sizes: tuple[int, ...] = (3, 2, 1), max_len: int = 8, tree: int = 0):
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        if not self.sizes or self.sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be positive integers, got {sizes}")
        self.max_len, self.tree = max_len, tree
        self._seq_id: object = None
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._done = 0  # n-grams ending before this position are indexed

    def propose(self, seq: "Sequence", k: int) -> Draft:
        return Draft.of(self.lookup(seq.uid, seq.tokens, k), seq.device)

    def propose_tree(self, seq: "Sequence", depth: int, nodes: int) -> Draft:
        """A tree of at most ``min(tree, nodes)`` nodes, each at most ``depth`` deep."""
        tokens, parents = suffix.select(self.ranked(seq.uid, seq.tokens, self.max_len), min(self.tree, nodes), depth)
        return Draft.of(tokens, seq.device, parents)

    def lookup(self, key: object, toks: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix.

        ``key`` names the sequence: the index is extended incrementally while it stays the same.
        """
        n, at = self._occurrences(key, toks)
        return toks[at[-1] : at[-1] + k] if at else []

    def ranked(self, key: object, toks: list[int], depth: int) -> suffix.Ranked:
        """The continuations of the latest ``suffix.OCCURRENCES`` earlier occurrences of the longest matching
        suffix, ranked (``suffix.ranked_from``; the latest first among equals)."""
        n, at = self._occurrences(key, toks)
        return suffix.ranked_from(toks, {p - 1: n for p in reversed(at[-suffix.OCCURRENCES :])}, depth)

    def _occurrences(self, key: object, toks: list[int]) -> tuple[int, list[int]]:
        """The longest n of ``sizes`` whose last n tokens occurred earlier, and the positions after those
        occurrences, oldest first ((0, []) if none)."""
        if self._seq_id != key or self._done > len(toks):
            self._seq_id, self._index, self._done = key, {}, 0
        # index n-grams that end at positions < len(toks) - 1, so the suffix never matches itself
        for end in range(self._done, len(toks) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self._index.setdefault(tuple(toks[end + 1 - n : end + 1]), []).append(end + 1)
        self._done = max(self._done, len(toks) - 1)
        for n in self.sizes:
            if len(toks) >= n:
                at = self._index.get(tuple(toks[-n:]))
                if at:
                    return n, at
        return 0, []


class Suffix(_Feedback):
    """SuffixDecoding's chain (``suffix.propose``) over an index of the sequence (its prompt and tokens so far,
    extended as it grows) and ``cache``, the earlier outputs of the sequences drafted with it, which ``finish``
    adds this one's to. With ``tree`` > 0, ``propose_tree`` drafts a token tree of at most that many nodes
    from the sequence's own matches (``suffix.draft_tree``), and the chain where it has none."""

    def __init__(self, max_len: int = 8, min_prob: float = 0.1, factor: float = 4.0,
                 cache: suffix.SuffixCache | None = None, tree: int = 0):
        self.max_len, self.min_prob, self.factor, self.cache, self.tree = max_len, min_prob, factor, cache, tree
        self._seq_id: object = None
        self._index = suffix.SequenceIndex()

    def _indexed(self, seq: "Sequence") -> suffix.SequenceIndex:
        if self._seq_id != seq.uid or len(self._index.tokens) > len(seq.tokens):
            self._seq_id, self._index = seq.uid, suffix.SequenceIndex()
        self._index.extend(seq.tokens[len(self._index.tokens) :])
        return self._index

    def propose(self, seq: "Sequence", k: int) -> Draft:
        return Draft.of(self.lookup(self._indexed(seq), k), seq.device)

    def propose_tree(self, seq: "Sequence", depth: int, nodes: int) -> Draft:
        """A tree of at most ``min(tree, nodes)`` nodes, each at most ``depth`` deep (the chain where the
        sequence has no earlier match)."""
        tokens, parents = suffix.draft_tree(self._indexed(seq), min(self.tree, nodes), depth)
        return Draft.of(tokens, seq.device, parents) if tokens else self.propose(seq, depth)

    def lookup(self, index: suffix.SequenceIndex, k: int) -> list[int]:
        """Up to k tokens after the sequence ``index`` holds (the search's simulator calls this too)."""
        return suffix.propose(index, self.cache, k, self.min_prob, self.factor)

    def finish(self, seq: "Sequence") -> None:
        if self.cache is not None:
            self.cache.add(seq.tokens[seq.n_prompt :])


class Hybrid(_Feedback):
    def __init__(self, ngram: NGram, layer_skip: LayerSkip):
        self.ngram, self.layer_skip = ngram, layer_skip
        self.max_len = max(ngram.max_len, layer_skip.max_len)

    def propose(self, seq: "Sequence", k: int) -> Draft:
        d = self.ngram.propose(seq, min(k, self.ngram.max_len))
        if draft_policy.hybrid_uses_ngram(d.tokens):
            return d
        return self.layer_skip.propose(seq, min(k, self.layer_skip.max_len))


@dataclass
class DrafterConfig:
    """What a bank stores per cluster: the drafter kind and its parameters."""

    kind: str = "none"  # one of KINDS; "none" = plain autoregressive decoding
    mask: dict | None = None  # SkipMask.to_dict() for layer_skip / hybrid
    max_len: int = 8  # most tokens drafted per step
    threshold: float = 0.0  # LayerSkip stops drafting when its top probability falls below this
    int8: bool = False  # LayerSkip drafts on int8 copies of the weights
    ngram_sizes: list[int] = field(default_factory=lambda: [3, 2, 1])
    ngram_max_len: int | None = None  # NGram's own cap in hybrid (default: max_len)
    adaptive: bool = False  # adapt the draft length: +2 after a fully accepted draft, -1 after a rejection
    suffix_min_prob: float = 0.1  # a suffix draft stops before its first token less likely than this
    suffix_factor: float = 4.0  # a suffix draft is at most this times its match's length (docs/benchmarks.md)
    tree: int = 0  # ngram, suffix: nodes of a token tree where one greedy sequence decodes (0: chains only)
    goodput: bool = False  # ngram, suffix: keep the part of each draft that pays (``draft_policy.Goodput``)

    def __post_init__(self):
        """One-line ``ValueError``s: a draft length under 1 silently turned drafting off, and a NaN
        threshold compared false everywhere."""
        if self.kind not in KINDS:
            raise ValueError(f"unknown drafter kind '{self.kind}' (choose {', '.join(KINDS)})")
        for name in ("max_len", "ngram_max_len"):
            v = getattr(self, name)
            if v is None and name == "ngram_max_len":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"draft length {name} must be an integer >= 1, got {v!r}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:  # NaN fails too
            raise ValueError(f"threshold must be a probability in [0, 1], got {t!r}")
        sizes = self.ngram_sizes
        if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"ngram_sizes must be integers >= 1, got {sizes!r}")
        p, f = self.suffix_min_prob, self.suffix_factor
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"suffix_min_prob must be a probability in [0, 1], got {p!r}")
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < float("inf"):
            raise ValueError(f"suffix_factor must be a number > 0, got {f!r}")
        n = self.tree
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"tree must be an integer >= 0 (0: chains only), got {n!r}")
        if n and self.kind not in ("ngram", "suffix"):
            raise ValueError(f"tree is for the ngram and suffix drafters, not {self.kind}")
        if not isinstance(self.goodput, bool):
            raise ValueError(f"goodput must be true or false, got {self.goodput!r}")
        if self.goodput and (self.kind not in ("ngram", "suffix") or self.adaptive or n):
            raise ValueError("goodput lengths are for the ngram and suffix drafters' chains, without adaptive "
                             f"lengths or a tree (got {self.kind}{', adaptive' if self.adaptive else ''}"
                             f"{', tree' if n else ''})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown drafter fields: {sorted(unknown)}")
        return cls(**d)

    def describe(self) -> str:
        if self.kind == "none":
            return "plain AR"
        parts = [self.kind, f"k<={self.max_len}"]
        if self.kind in SKIPPING and self.mask is not None:
            m = SkipMask.from_dict(self.mask)
            parts.append(f"skip {m.n_skipped}/{2 * m.n_layers}")
            if self.threshold:
                parts.append(f"conf>={self.threshold:.2f}")
            if self.int8:
                parts.append("int8")
        if self.kind in ("ngram", "hybrid"):
            parts.append("n=" + ",".join(map(str, self.ngram_sizes)))
        if self.kind == "suffix":
            parts.append(f"p>={self.suffix_min_prob:g} x{self.suffix_factor:g}")
        if self.tree and self.kind in ("ngram", "suffix"):
            parts.append(f"tree {self.tree}")
        if self.adaptive:
            parts.append("adaptive")
        if self.goodput:
            parts.append("goodput")
        return " ".join(parts)


# the lookup drafters that run untuned, one configuration for every prompt: what routing must beat (issue 64)
FIXED = ("ngram", "suffix")


def untuned(kind: str) -> DrafterConfig:
    """A lookup drafter's settings with nothing searched: bench-engine's and ``knnssd bench``'s rows, and a
    candidate of every search's real timing that may draft by lookup, beside the search's own choice."""
    if kind == "ngram":
        return DrafterConfig(kind="ngram", max_len=8, ngram_sizes=[3, 2, 1], adaptive=True)
    if kind == "suffix":
        return DrafterConfig(kind="suffix", max_len=8)
    raise ValueError(f"no untuned settings for drafter kind '{kind}' (ngram, suffix)")


def fixed_drafters(n_layers: int, can_skip: bool = True) -> dict[str, "Drafter"]:
    """One drafter of each of ``FIXED``, the suffix one with a cache of its own earlier outputs (as a bank's
    suffix clusters share one): what ``knnssd bench`` and the demo put routing beside."""
    return {k: build(untuned(k), n_layers, can_skip, suffix.SuffixCache()) for k in FIXED}


def fixed_kind(config: dict) -> str | None:
    """Which of ``FIXED`` a configuration (``DrafterConfig.to_dict()``) is, with its untuned settings; None for
    a tuned one, another kind or plain decoding."""
    cfg = DrafterConfig.from_dict(config)
    return next((k for k in FIXED if cfg == untuned(k)), None)


def build(cfg: DrafterConfig, n_layers: int, can_skip: bool = True, cache: suffix.SuffixCache | None = None
          ) -> Drafter | None:
    """A drafter for a model with ``n_layers`` layers; None for plain AR. Raises MaskError on a bad mask.
    ``cache``: the earlier outputs a suffix drafter reads and adds to (a bank's, shared by its sequences)."""
    if cfg.kind == "none":
        return None
    if cfg.kind == "suffix":
        d = Suffix(cfg.max_len, cfg.suffix_min_prob, cfg.suffix_factor, cache, cfg.tree)
        d.adaptive, d.goodput = cfg.adaptive, draft_policy.Goodput() if cfg.goodput else None
        return d
    ngram = NGram(tuple(cfg.ngram_sizes), cfg.ngram_max_len or cfg.max_len)
    if cfg.kind == "ngram":
        ngram.adaptive, ngram.tree = cfg.adaptive, cfg.tree
        ngram.goodput = draft_policy.Goodput() if cfg.goodput else None
        return ngram
    mask = SkipMask.from_dict(cfg.mask) if cfg.mask is not None else SkipMask.none(n_layers)
    mask.validate(n_layers, can_skip)
    if cfg.int8 and not can_skip:
        raise MaskError("int8 drafting needs the lean forward; this model runs on the plain HF fallback")
    skip = LayerSkip(mask, cfg.max_len, cfg.threshold, cfg.int8)
    drafter = skip if cfg.kind == "layer_skip" else Hybrid(ngram, skip)
    drafter.adaptive = cfg.adaptive
    return drafter
