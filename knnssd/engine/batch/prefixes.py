"""Prefix reuse in a batch: a prompt whose leading tokens equal another's copies their K/V instead of
computing them (``Prefixes``), where ``prefix_exact`` measures that exact on the real model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from knnssd.engine.model.attention import CAUSAL_BLOCK, PREFILL_ROWS
from knnssd.engine.spec.loop import GenerationConfig, Reused, prefill, reusable, reuse_unit_of
from knnssd.engine.spec.sequence import Sequence
from knnssd.engine.model.decoder import Decoder


class Prefixes:
    """The prompts of the sequences in a batch, and of finished ones whose slots are free, for the next
    prompts' prefills to reuse (vLLM's prefix caching, over a batch's slots). ``prefill``
    (``loop.prefill``'s signature) finds the one whose prompt shares the most leading tokens with the
    new one, and copies the K/V and states of those positions from its slot (``loop.Reused``) instead
    of computing them, as far as ``loop.reusable`` allows (any number of positions where the prefill's
    attention is the native kernel, else whole blocks of ``CAUSAL_BLOCK``: ``attention.reuse_unit``; the
    rest gets the rows its own prefill would). Few-shot prompts share their examples: in the 64 mixed
    eval prompts of ``bench-throughput``, each summarization prompt starts with the same 354-token
    example article, and every prompt with its chat template's system turn.

    A finished sequence's prompt lends until its slot takes another job (``drop``: its buffers are that
    job's), so a prompt also reuses one that finished before it started: in a server, the request
    before it (vLLM's automatic prefix caching keeps freed blocks the same way, until it evicts them)."""

    def __init__(self):
        self._held: dict[int, _Prompt] = {}  # by id(slot)
        self.reused = 0  # prompt positions copied instead of computed

    def prefill(self, decoder: Decoder, prompt_ids: list[int], config: GenerationConfig, tap: int | None = None
                ) -> tuple[Sequence, torch.Tensor, torch.Tensor]:
        unit = reuse_unit_of(decoder)
        reuse = self._find(prompt_ids, tap, unit)
        seq, logits, states = prefill(decoder, prompt_ids, config, tap, reuse)
        lends = len(prompt_ids) // unit * unit
        if lends:
            self._held[id(decoder)] = _Prompt(decoder, list(prompt_ids[:lends]), states[:lends].clone(), tap)
        self.reused += reuse.n if reuse is not None else 0
        return seq, logits, states

    def drop(self, slot: Decoder) -> None:
        self._held.pop(id(slot), None)

    def _find(self, ids: list[int], tap: int | None, unit: int) -> Reused | None:
        limit = reusable(len(ids), len(ids), unit)
        best, lender = 0, None
        for p in self._held.values():
            if p.tap != tap:  # its states are another layer's
                continue
            common = next((i for i, (a, b) in enumerate(zip(p.ids[:limit], ids[:limit])) if a != b),
                          min(limit, len(p.ids)))
            n = common // unit * unit
            if n > best:
                best, lender = n, p
        return None if lender is None else Reused(best, lender.slot.cache, lender.states[:best], tap)


@dataclass(frozen=True)
class _Prompt:
    """A sequence's prompt as far as it can lend it (whole units, ``attention.reuse_unit``): its slot, which
    holds the K/V, its tokens and the states its prefill returned."""

    slot: Decoder
    ids: list[int]
    states: torch.Tensor
    tap: int | None


@torch.inference_mode()
def prefix_exact(decoder: Decoder, pooled: bool) -> bool:
    """Does a prompt that reuses another's leading positions (``Prefixes``) get the K/V, states and logits its
    own prefill gives? Checked on the real model, bitwise, against each prompt prefilled alone on a slot of
    its own (``pooled``: the slots of one ``SlotPool``): a random prompt of five blocks and 30 tokens lends
    to one of two of its blocks and the fewest tokens a rest may have (a shorter borrower, mostly reused)
    and to one of four of its blocks and 100 tokens (past 512 keys: CPU flash attention's key split);
    where any number of positions may be reused (``attention.reuse_unit``), also to one of its first
    block and 45 tokens, and 60 more (a shared part that ends inside a block)."""
    B = CAUSAL_BLOCK
    slots = decoder.pooled_slots(3)[0] if pooled else [decoder.slot() for _ in range(3)]
    vocab = decoder.stack.embed.shape[0]
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    lender = rand(5 * B + 30)
    cfg = GenerationConfig(max_new_tokens=1)
    store = Prefixes()
    store.prefill(slots[0], lender, cfg)
    cases = [(2 * B, PREFILL_ROWS + 1), (4 * B, 100)]  # (tokens shared, tokens after them)
    if reuse_unit_of(decoder) < B:
        cases.append((B + 45, 60))
    for shared, rest in cases:
        ids = lender[:shared] + [(lender[shared] + 1) % vocab] + rand(rest - 1)  # the rest differs from its first
        before = store.reused
        _, logits, states = store.prefill(slots[1], ids, cfg)
        _, own_logits, own_states = prefill(slots[2], ids, cfg)
        store.drop(slots[1])
        kv = lambda c: [t[:, :, : len(ids)] for t in c.k + c.v]  # noqa: E731
        if not (store.reused - before == shared and torch.equal(logits, own_logits)
                and torch.equal(states, own_states)
                and all(torch.equal(a, b) for a, b in zip(kv(slots[1].cache), kv(slots[2].cache)))):
            return False
    return True
