"""Acceptance math for speculative decoding: pure functions over tensors.

Terms (used throughout):
    k           number of drafted tokens in a step (0 <= k)
    x_1..x_k    the drafted tokens
    q_i         the draft's distribution at position i (after warping); None for a deterministic
                drafter (n-gram lookup), which is the point mass on x_i
    p_i         the target model's distribution at position i (after warping), i = 1..k+1;
                p_{k+1} is the distribution after the last drafted token ("bonus" position)
    warping     temperature, then top-k, then top-p (nucleus), as HF applies them

Greedy: accept the longest prefix with x_i == argmax p_i, then emit argmax p at the first
mismatch (or at k+1). The result is token-identical to greedy decoding.

Sampling (Leviathan et al. 2023; Chen et al. 2023): accept x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample of norm(max(0, p_i - q_i));
if all k are accepted emit a sample of p_{k+1}. Every emitted token is then distributed exactly
as under plain sampling from p, whatever q is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Warp:
    """Sampling parameters; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (self.temperature, self.top_p, self.top_k))
        if not finite or self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling parameters: temperature={self.temperature} (finite, >= 0), "
                             f"top_k={self.top_k} (>= 0), top_p={self.top_p} (in (0, 1])")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs(logits: torch.Tensor, warp: Warp) -> torch.Tensor:
    """Warped distribution over the vocabulary, (..., V) float32."""
    logits = logits.float() / warp.temperature
    if warp.top_k and warp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, warp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if warp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum <= 1 - warp.top_p
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator).item())


def greedy_verify(drafted: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """(number of drafted tokens accepted, next token). drafted: (k,); target_logits: (k+1, V)."""
    best = target_logits.argmax(-1)
    k = drafted.shape[0]
    n = int(torch.cumprod(best[:k] == drafted, 0).sum().item()) if k else 0
    return n, int(best[n].item())


def rejection_verify(
    drafted: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(number accepted, next token) for speculative sampling.

    drafted: (k,) tokens x_i; q: (k, V) draft distributions or None (point masses at x_i);
    p: (k+1, V) target distributions. Uses k+1 uniforms from ``generator``.
    """
    k = drafted.shape[0]
    if k == 0:
        return 0, sample(p[0], generator)
    idx = torch.arange(k, device=p.device)
    p_x = p[idx, drafted]
    q_x = torch.ones_like(p_x) if q is None else q[idx, drafted]
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = u * q_x < p_x  # u < p/q without dividing by zero
    n = int(torch.cumprod(accepted, 0).sum().item())
    if n == k:
        return n, sample(p[k], generator)
    if q is None:
        residual = p[n].clone()
        residual[drafted[n]] = 0
    else:
        residual = (p[n] - q[n]).clamp_min(0)
    total = residual.sum()
    if total <= 0:  # p == q at this position: rejection had probability 0; guard rounding
        residual, total = p[n], p[n].sum()
    return n, sample(residual / total, generator)
