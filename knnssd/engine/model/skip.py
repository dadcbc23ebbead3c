"""Skip masks: one bit per attention sub-layer and one per MLP sub-layer; a set bit means the residual
branch is left out (the hidden state passes through unchanged, and a skipped attention writes no K/V).
``decoder.Decoder`` runs them; the same cache serves drafts and the full model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

class MaskError(ValueError):
    """A skip mask does not fit the model (one line, for the user)."""


@dataclass(frozen=True)
class SkipMask:
    attn: tuple[bool, ...]  # attn[i]: skip the attention sub-layer of layer i
    mlp: tuple[bool, ...]  # mlp[i]: skip the MLP sub-layer of layer i

    @classmethod
    def none(cls, n_layers: int) -> "SkipMask":
        return cls((False,) * n_layers, (False,) * n_layers)

    @classmethod
    def from_bits(cls, bits, n_layers: int | None = None) -> "SkipMask":
        """From 2L bits: the L attention bits, then the L MLP bits."""
        bits = [bool(b) for b in bits]
        if len(bits) % 2 or (n_layers is not None and len(bits) != 2 * n_layers):
            want = f"{2 * n_layers}" if n_layers is not None else "an even number of"
            raise MaskError(f"skip mask has {len(bits)} bits; needs {want} (one attention and one MLP bit per layer)")
        half = len(bits) // 2
        return cls(tuple(bits[:half]), tuple(bits[half:]))

    @classmethod
    def from_layers(cls, n_layers: int, attn=(), mlp=()) -> "SkipMask":
        """From the indices of the skipped attention and MLP sub-layers."""
        for i in (*attn, *mlp):
            if not 0 <= int(i) < n_layers:
                raise MaskError(f"skip mask names layer {i}; the model has layers 0..{n_layers - 1}")
        a, m = set(map(int, attn)), set(map(int, mlp))
        return cls(tuple(i in a for i in range(n_layers)), tuple(i in m for i in range(n_layers)))

    @property
    def n_layers(self) -> int:
        return len(self.attn)

    @property
    def bits(self) -> list[int]:
        return [int(b) for b in self.attn + self.mlp]

    @property
    def n_skipped(self) -> int:
        return sum(self.attn) + sum(self.mlp)

    @property
    def fraction(self) -> float:
        return self.n_skipped / max(1, 2 * self.n_layers)

    def to_dict(self) -> dict:
        return {
            "n_layers": self.n_layers,
            "skip_attn": [i for i, b in enumerate(self.attn) if b],
            "skip_mlp": [i for i, b in enumerate(self.mlp) if b],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "SkipMask":
        if not isinstance(d, dict):
            raise MaskError(f"not a skip mask (a JSON object with n_layers, skip_attn, skip_mlp): {d!r:.120}")
        unknown = sorted(set(d) - {"n_layers", "skip_attn", "skip_mlp"})
        if unknown:  # a typo ("skip_mpl") would otherwise skip nothing, unsaid
            raise MaskError(f"skip mask has unknown fields {unknown}; it takes n_layers, skip_attn, skip_mlp")
        try:
            # integers only: ``int()`` would take 2.7 for layer 2, and "3" or true for a count
            for key in ("skip_attn", "skip_mlp"):
                if not all(_is_int(i) for i in d.get(key, ())):
                    raise MaskError(f"skip mask {key} must list layer indices (integers), got {d[key]!r:.80}")
            if not _is_int(d["n_layers"]):
                raise MaskError(f"skip mask n_layers must be an integer, got {d['n_layers']!r:.40}")
            return cls.from_layers(d["n_layers"], d.get("skip_attn", ()), d.get("skip_mlp", ()))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, MaskError):
                raise
            raise MaskError(f"not a skip mask: {d!r:.120}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "SkipMask":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise MaskError(f"skip mask is not valid JSON: {e}") from None

    def validate(self, n_layers: int, can_skip: bool = True) -> "SkipMask":
        if len(self.attn) != len(self.mlp) or self.n_layers != n_layers:
            raise MaskError(f"skip mask is for {self.n_layers} layers; the model has {n_layers}")
        if self.n_skipped and not can_skip:
            raise MaskError("this model runs on the plain HF fallback, which cannot skip sub-layers")
        return self

    def __str__(self) -> str:
        a = "".join("1" if b else "0" for b in self.attn)
        m = "".join("1" if b else "0" for b in self.mlp)
        return f"attn:{a} mlp:{m}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
