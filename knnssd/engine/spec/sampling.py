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

Both run on the device (vLLM's rejection sampler's shape): ``accept_greedy`` and ``accept_sampled``
return the step's verdict packed in one tensor, and ``Verdict.read`` is the step's one host copy.
A draft cut on the device at m <= k tokens (``kept``) is verified as a draft of m tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


# Below this temperature logits / temperature overflow float32 (at 1e-39 every token came out as id 0),
# and long before it sampling is greedy in all but name.
MIN_TEMPERATURE = 1e-6


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
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature:g}")

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


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index i of ``weights`` (..., V), nonnegative and not all zero, with probability weights_i / sum,
    as a long tensor on the device (...,): the exponential race argmax_i weights_i / E_i, E_i ~ Exp(1), so
    no host read and no normalising."""
    race = torch.empty_like(weights, dtype=torch.float32).exponential_(generator=generator)
    return weights.float().div(race.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)  # never 0 / 0


# A step's verdict, packed on the device so the host reads it once: (3 + k,) long
#     [n, m, y, x_1..x_k]   n drafted tokens accepted (n <= m), m of the k drafted tokens verified
#                           (a confidence cut made on the device may keep fewer than k), y the next token
_N, _M, _Y, _HEAD = 0, 1, 2, 3


@dataclass(frozen=True)
class Verdict:
    accepted: int  # n
    drafted: tuple[int, ...]  # x_1..x_m: the drafted tokens that were verified
    next: int  # y
    next_ids: torch.Tensor  # (1,): y on the device, for the next draft and pass (no host-to-device copy)

    @classmethod
    def read(cls, packed: torch.Tensor) -> "Verdict":
        """From ``accept_greedy``'s or ``accept_sampled``'s packed tensor: the step's one host copy."""
        return cls.of(packed.tolist(), packed)

    @classmethod
    def read_later(cls, packed: torch.Tensor) -> Callable[[], "Verdict"]:
        """Start ``packed``'s host copy and return a function that waits for it and reads it: the device runs
        on meanwhile (on CUDA; elsewhere the copy is made now)."""
        if packed.device.type != "cuda":
            verdict = cls.read(packed)
            return lambda: verdict
        host = packed.to("cpu", non_blocking=True)  # into pinned memory: the copy does not block the host
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(packed.device))  # the stream the copy is on, whatever device is current

        def wait() -> "Verdict":
            copied.synchronize()
            return cls.of(host.tolist(), packed)

        return wait

    @staticmethod
    def next_of(packed: torch.Tensor) -> torch.Tensor:
        """(1,): the token y of a packed verdict, on the device, before the verdict is read."""
        return packed[_Y : _Y + 1]

    @classmethod
    def read_all(cls, packed: list[torch.Tensor]) -> list["Verdict"]:
        """Several sequences' verdicts with one host copy (a batched step)."""
        values = torch.cat(packed).tolist()
        out, at = [], 0
        for p in packed:
            out.append(cls.of(values[at : at + p.shape[0]], p))
            at += p.shape[0]
        return out

    @classmethod
    def of(cls, values: list[int], packed: torch.Tensor) -> "Verdict":
        n, m, y = values[_N], values[_M], values[_Y]
        return cls(n, tuple(values[_HEAD : _HEAD + m]), y, packed[_Y : _Y + 1])

    @property
    def emitted(self) -> list[int]:
        return [*self.drafted[: self.accepted], self.next]

    @property
    def reported_len(self) -> int:
        """The draft length the adaptive rule is told (``draft_policy.next_len``): every verified token."""
        return len(self.drafted)


def _verified(drafted: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """m, 0-d: how many drafted tokens are verified (``kept``, or all k)."""
    return torch.full((), drafted.shape[0], dtype=torch.long, device=drafted.device) if kept is None else kept.long()


def _accepted(ok: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """n, 0-d: the length of the accepted prefix of ``ok`` (k,), within its first m positions."""
    ok = ok & (torch.arange(ok.shape[0], device=ok.device) < m)
    return ok.long().cumprod(0).sum()


def accept_greedy(drafted: torch.Tensor, logits: torch.Tensor, kept: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy verification on the device. drafted (k,), logits (k+1, V), ``kept`` (0-d, optional): verify only
    the first ``kept`` drafted tokens. Returns the packed verdict (``Verdict.read``)."""
    best = logits.argmax(-1)
    if not drafted.shape[0]:  # plain decoding's step: n = m = 0, y = argmax p_1
        return torch.cat((best.new_zeros(2), best))
    m = _verified(drafted, kept)
    n = _accepted(best[: drafted.shape[0]] == drafted, m)
    return torch.cat((n.view(1), m.view(1), best.gather(0, n.view(1)), drafted))


def accept_sampled(drafted: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None,
                   kept: torch.Tensor | None = None) -> torch.Tensor:
    """Speculative sampling on the device. drafted (k,) tokens x_i; q (k, V) draft distributions or None
    (point masses at x_i); p (k+1, V) target distributions; ``kept`` as in ``accept_greedy``. Uses k
    uniforms and one exponential race over V from ``generator``. Returns the packed verdict."""
    k = drafted.shape[0]
    idx = torch.arange(k, device=p.device)
    p_x = p[idx, drafted]
    q_x = torch.ones_like(p_x) if q is None else q[idx, drafted]
    u = torch.rand(k, generator=generator, device=p.device)
    m = _verified(drafted, kept)
    n = _accepted(u * q_x < p_x, m)  # u < p/q without dividing by zero
    at = n.view(1)  # rows picked by index_select: a 0-d tensor index would be read on the host
    p_n = p.index_select(0, at)[0]
    row = p_n  # n == m: every verified token accepted, sample p at the position after them
    if k:  # at a rejection (n < m), the residual norm(max(0, p_n - q_n)) instead
        below = at.clamp_max(k - 1)
        if q is None:
            residual = p_n.scatter(0, drafted.index_select(0, below), 0.0)
        else:
            residual = (p_n - q.index_select(0, below)[0]).clamp_min(0)
        row = torch.where(n < m, residual, p_n)
        row = torch.where(row.sum() > 0, row, p_n)  # p == q at this position: rejection had probability 0
    return torch.cat((n.view(1), m.view(1), draw(row, generator).view(1), drafted))
