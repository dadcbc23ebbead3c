"""What one generation request asks for (``GenerateParams``) and the one prompt policy (checked,
tokenized, truncated to its last tokens): shared by the CLI, batch generation and serving."""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from knnssd.engine.sampling import Warp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerateParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_prompt_tokens: int = 4096  # longer prompts keep their last tokens (with a warning)

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k", "max_prompt_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_new_tokens < 1 or self.max_prompt_tokens < 1:
            raise ValueError(f"max_new_tokens and max_prompt_tokens must be >= 1, got {self.max_new_tokens} and "
                             f"{self.max_prompt_tokens}")
        self.warp  # validates temperature, top_k, top_p (finite, in range)

    @property
    def warp(self) -> Warp:
        return Warp(self.temperature, self.top_k, self.top_p)

    @classmethod
    def from_dict(cls, d: dict) -> "GenerateParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown generation parameters: {sorted(unknown)} (known: {sorted(known)})")
        d = {k: _number(k, v) for k, v in d.items() if v is not None}
        if isinstance(d.get("seed"), int) and d["seed"] < 0:  # seed -1: random
            del d["seed"]
        return cls(**d)


def _number(name: str, v):
    """Integral floats (JSON 8.0) become ints; NaN and inf stay floats, for the checks to name."""
    if isinstance(v, float) and v.is_integer() and name in ("max_new_tokens", "top_k", "max_prompt_tokens", "seed"):
        return int(v)
    return v


def check_prompt(prompt) -> None:
    """A one-line ``ValueError`` for a prompt no model can take: not text, not UTF-8, or blank."""
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be text, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("prompt is not valid UTF-8 text") from None
    if not prompt.strip():
        raise ValueError("empty prompt")


def prompt_ids(tokenizer, prompt: str, limit: int) -> tuple[list[int], bool]:
    """Token ids of ``prompt``, keeping the last ``limit`` of a longer one (warned); True if truncated.
    The one prompt policy of ``generate``, ``complete`` and serving."""
    check_prompt(prompt)
    ids = tokenizer(prompt).input_ids
    if len(ids) > limit:
        log.warning("prompt of %d tokens truncated to its last %d", len(ids), limit)
        return ids[-limit:], True
    return ids, False
