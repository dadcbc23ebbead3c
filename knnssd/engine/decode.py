"""The speculative decoding loop: prefill, then draft -> verify -> accept until done.

    tokens = prompt;  prefill(prompt) -> first token
    loop:
        x_1..x_k = drafter.propose(tokens)             # k = 0 without a drafter: plain AR
        p_1..p_{k+1} = model([tokens[-1], x_1..x_k])     # one full forward from the KV cache
        n, y = verify(x, p)                              # sampling.py
        tokens += x_1..x_n, y;  cache.rollback(len(tokens) - 1)

Plain autoregressive decoding is the same loop with no drafter, so the two are measured by
the same code. ``generate`` returns the new tokens and a ``DecodeStats``.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from knnssd.engine.drafters import Drafter
from knnssd.engine.sampling import Warp, greedy_verify, probs, rejection_verify, sample
from knnssd.engine.sequence import Sequence


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    warp: Warp = Warp()
    seed: int | None = None
    eos_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # generation stops after the token that completes one (kept)


def acceptance_rate(accepted: int, drafted: int) -> float:
    """Accepted drafted tokens / drafted tokens (0 when nothing was drafted)."""
    return accepted / drafted if drafted else 0.0


def mean_accepted(accepted: int, steps: int) -> float:
    """Tokens emitted per full-model step after the prefill: the accepted drafts plus each step's own
    token, over the steps (1.0 for plain AR, and when nothing ran)."""
    return (accepted + steps) / steps if steps else 1.0


@dataclass
class DecodeStats:
    """What one generation did. ``accepted[i]`` drafted tokens were accepted at verify step i."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # full-model passes after the prefill
    drafted: int = 0
    accepted: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop: str = ""  # "eos" | "length" | "stop_string"
    exact: bool = False  # the decoder's verify pass was measured row-invariant (exactness.py): output == plain
    step: str = ""  # the attention implementation the decoder runs

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(sum(self.accepted), self.drafted)

    @property
    def mean_accepted(self) -> float:
        return mean_accepted(sum(self.accepted), len(self.accepted))

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted=self.mean_accepted, tokens_per_s=self.tokens_per_s)
        return d


class _Stopper:
    def __init__(self, config: GenerationConfig, tokenizer):
        if config.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.eos = set(config.eos_ids)
        self.max_new = config.max_new_tokens
        self.strings = config.stop_strings
        self.tokenizer = tokenizer
        self.window = max((len(s) for s in self.strings), default=0) + 4

    def check(self, new: list[int]) -> str:
        if new[-1] in self.eos:
            return "eos"
        if self.strings:
            tail = self.tokenizer.decode(new[-self.window :])
            if any(s in tail for s in self.strings):
                return "stop_string"
        if len(new) >= self.max_new:
            return "length"
        return ""


def prefill(decoder, prompt_ids: list[int], config: GenerationConfig, tap: int | None = None
            ) -> tuple[Sequence, torch.Tensor, torch.Tensor]:
    """Run the prompt; returns the sequence, the last position's logits (V,) and the prompt's hidden
    states (T, E): final-normed, or the residual stream after layer ``tap`` when given."""
    if not prompt_ids:
        raise ValueError("empty prompt: at least one token is needed")
    device = decoder.device
    gen = None
    if not config.warp.greedy:
        gen = torch.Generator(device=device)
        gen.manual_seed(config.seed if config.seed is not None else torch.seed())
    decoder.reserve(len(prompt_ids) + config.max_new_tokens)  # the key length: the same for every drafter
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    out = decoder.forward(ids, 0, last=True, tap=tap)
    seq = Sequence(list(prompt_ids), len(prompt_ids), decoder, config.warp, gen, device)
    return seq, out.logits[0], out.hidden if out.tapped is None else out.tapped


def decode(
    seq: Sequence, first_logits: torch.Tensor, drafter: Drafter | None, config: GenerationConfig, tokenizer=None
) -> tuple[list[int], DecodeStats]:
    """Continue a prefilled sequence until EOS, max_new_tokens or a stop string."""
    warp, dec = config.warp, seq.decoder
    ex = dec.exactness
    stats = DecodeStats(prompt_tokens=seq.n_prompt, exact=bool(ex and ex.exact), step=ex.step if ex else "")
    stopper = _Stopper(config, tokenizer)
    max_draft = ex.max_t - 1 if ex else 1 << 30  # longer passes were not probed
    k = drafter.max_len if drafter is not None else 0  # draft length; the drafter's feedback adapts it
    first = int(first_logits.argmax().item()) if warp.greedy else sample(probs(first_logits, warp), seq.generator)
    new = [first]
    seq.tokens.append(first)
    stats.stop = stopper.check(new)
    while not stats.stop:
        t0 = time.perf_counter()
        room = config.max_new_tokens - len(new) - 1  # drafts beyond this could never be emitted
        draft = drafter.propose(seq, min(k, room, max_draft)) if drafter is not None and room > 0 else None
        drafted = draft.tokens if draft is not None else []
        t1 = time.perf_counter()
        start = len(seq.tokens) - 1
        ids = torch.tensor([seq.tokens[-1], *drafted], dtype=torch.long, device=seq.device)
        logits = dec.forward(ids, start, last=not drafted).logits
        x = ids[1:]
        if warp.greedy:
            n, nxt = greedy_verify(x, logits)
        else:
            n, nxt = rejection_verify(x, draft.q if draft is not None else None, probs(logits, warp), seq.generator)
        stats.draft_s += t1 - t0
        stats.verify_s += time.perf_counter() - t1
        stats.steps += 1
        stats.drafted += len(drafted)
        stats.accepted.append(n)
        if drafter is not None:
            k = drafter.next_len(k, len(drafted), n)
        for tok in (*drafted[:n], nxt):
            new.append(tok)
            seq.tokens.append(tok)
            stats.stop = stopper.check(new)
            if stats.stop:
                break
        dec.rollback(len(seq.tokens) - 1)
    stats.new_tokens = len(new)
    return new, stats


def generate(
    decoder, prompt_ids: list[int], drafter: Drafter | None = None, config: GenerationConfig = GenerationConfig(),
    tokenizer=None,
) -> tuple[list[int], DecodeStats]:
    """Generate from ``prompt_ids``; returns (new tokens, stats). Greedy output equals plain greedy decoding."""
    t0 = time.perf_counter()
    seq, logits, _ = prefill(decoder, prompt_ids, config)
    t1 = time.perf_counter()
    new, stats = decode(seq, logits, drafter, config, tokenizer)
    stats.prefill_s = t1 - t0
    stats.total_s = time.perf_counter() - t0
    return new, stats
