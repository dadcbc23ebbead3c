"""Zero-training drafters behind one small interface.

A drafter proposes up to ``k`` next tokens for a ``Sequence`` (the tokens so far and the
decoder with its KV cache); the full model then verifies them in one pass (``decode.py``).

    LayerSkip  the model itself with some sub-layers skipped (a ``SkipMask``), optionally on
               int8 copies of its weights; stops early when its confidence drops below a threshold
    NGram      prompt lookup: continue the latest earlier occurrence of the last n tokens (prompt
               + generated text), trying the longest n first; costs no forward pass
    Hybrid     NGram when it finds a match, LayerSkip otherwise

``DrafterConfig`` is the serialisable description (what the search tunes and banks store);
``build`` turns it into a drafter for a given decoder.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from knnssd.engine.sampling import probs, sample
from knnssd.engine.sequence import Sequence
from knnssd.engine.skip import MaskError, SkipMask

KINDS = ("none", "layer_skip", "ngram", "hybrid")


@dataclass
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # (len(tokens), V) draft distributions when sampling; None = point masses


class Drafter(Protocol):
    max_len: int  # most tokens per draft
    adaptive: bool  # shorten/lengthen drafts after rejections/full acceptances

    def propose(self, seq: "Sequence", k: int) -> Draft: ...

    def next_len(self, k: int, drafted: int, accepted: int) -> int: ...


def adapt_length(k: int, max_len: int, drafted: int, accepted: int) -> int:
    """HF's schedule (``candidate_generator.py``): +2 after a fully accepted draft, else -1, within 1..max_len."""
    if not drafted:
        return k
    return min(max_len, k + 2) if accepted == drafted else max(1, k - 1)


class _Feedback:
    """The draft-length feedback every drafter shares: the loop and the search's simulator call it."""

    max_len: int
    adaptive = False

    def next_len(self, k: int, drafted: int, accepted: int) -> int:
        """The next draft length after a step that drafted ``drafted`` tokens and accepted ``accepted``."""
        return adapt_length(k, self.max_len, drafted, accepted) if self.adaptive else k


class LayerSkip(_Feedback):

    def __init__(self, mask: SkipMask, max_len: int = 8, threshold: float = 0.0, int8: bool = False):
        self.mask, self.max_len, self.threshold, self.int8 = mask, max_len, threshold, int8
        self._stack = None

    def propose(self, seq: "Sequence", k: int) -> Draft:
        dec = seq.decoder
        if self.int8 and self._stack is None:
            self._stack = dec.int8_stack()
        tok, pos = seq.tokens[-1], len(seq.tokens) - 1
        out: list[int] = []
        qs: list[torch.Tensor] = []
        ids = torch.empty(1, dtype=torch.long, device=seq.device)
        for i in range(k):
            ids[0] = tok
            logits = dec.forward(ids, pos + i, self.mask, stack=self._stack, last=True).logits[0]
            if seq.warp.greedy:
                tok = int(logits.argmax().item())
                conf = float(logits.softmax(-1)[tok].item()) if self.threshold > 0 else 1.0
            else:
                q = probs(logits, seq.warp)
                tok = sample(q, seq.generator)
                qs.append(q)
                conf = float(q[tok].item())
            out.append(tok)
            if conf < self.threshold:
                break
        return Draft(out, torch.stack(qs) if qs else None)


class NGram(_Feedback):
    """Prompt lookup with an incremental index: n-gram -> position after its latest occurrence."""

    def __init__(self, sizes: tuple[int, ...] = (3, 2, 1), max_len: int = 8):
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        if not self.sizes or self.sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be positive integers, got {sizes}")
        self.max_len = max_len
        self._seq_id: object = None
        self._index: dict[tuple[int, ...], int] = {}
        self._done = 0  # n-grams ending before this position are indexed

    def propose(self, seq: "Sequence", k: int) -> Draft:
        return Draft(self.lookup(seq.uid, seq.tokens, k))

    def lookup(self, key: object, toks: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix.

        ``key`` names the sequence: the index is extended incrementally while it stays the same.
        """
        if self._seq_id != key or self._done > len(toks):
            self._seq_id, self._index, self._done = key, {}, 0
        # index n-grams that end at positions < len(toks) - 1, so the suffix never matches itself
        for end in range(self._done, len(toks) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self._index[tuple(toks[end + 1 - n : end + 1])] = end + 1
        self._done = max(self._done, len(toks) - 1)
        for n in self.sizes:
            if len(toks) >= n:
                j = self._index.get(tuple(toks[-n:]))
                if j is not None:
                    return toks[j : j + k]
        return []


class Hybrid(_Feedback):
    def __init__(self, ngram: NGram, layer_skip: LayerSkip):
        self.ngram, self.layer_skip = ngram, layer_skip
        self.max_len = max(ngram.max_len, layer_skip.max_len)

    def propose(self, seq: "Sequence", k: int) -> Draft:
        d = self.ngram.propose(seq, min(k, self.ngram.max_len))
        if d.tokens:
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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown drafter fields: {sorted(unknown)}")
        cfg = cls(**d)
        if cfg.kind not in KINDS:
            raise ValueError(f"unknown drafter kind '{cfg.kind}' (choose {', '.join(KINDS)})")
        if cfg.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {cfg.max_len}")
        return cfg

    def describe(self) -> str:
        if self.kind == "none":
            return "plain AR"
        parts = [self.kind, f"k<={self.max_len}"]
        if self.kind in ("layer_skip", "hybrid") and self.mask is not None:
            m = SkipMask.from_dict(self.mask)
            parts.append(f"skip {m.n_skipped}/{2 * m.n_layers}")
            if self.threshold:
                parts.append(f"conf>={self.threshold:.2f}")
            if self.int8:
                parts.append("int8")
        if self.kind in ("ngram", "hybrid"):
            parts.append("n=" + ",".join(map(str, self.ngram_sizes)))
        if self.adaptive:
            parts.append("adaptive")
        return " ".join(parts)


def build(cfg: DrafterConfig, n_layers: int, can_skip: bool = True) -> Drafter | None:
    """A drafter for a model with ``n_layers`` layers; None for plain AR. Raises MaskError on a bad mask."""
    if cfg.kind == "none":
        return None
    ngram = NGram(tuple(cfg.ngram_sizes), cfg.ngram_max_len or cfg.max_len)
    if cfg.kind == "ngram":
        ngram.adaptive = cfg.adaptive
        return ngram
    mask = SkipMask.from_dict(cfg.mask) if cfg.mask is not None else SkipMask.none(n_layers)
    mask.validate(n_layers, can_skip)
    if cfg.int8 and not can_skip:
        raise MaskError("int8 drafting needs the lean forward; this model runs on the plain HF fallback")
    skip = LayerSkip(mask, cfg.max_len, cfg.threshold, cfg.int8)
    drafter = skip if cfg.kind == "layer_skip" else Hybrid(ngram, skip)
    drafter.adaptive = cfg.adaptive
    return drafter
