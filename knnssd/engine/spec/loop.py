"""The speculative decoding loop: prefill, then draft -> verify -> accept until done.

    tokens = prompt;  prefill(prompt) -> first token
    loop:
        x_1..x_k = drafter.propose(tokens)             # k = 0 without a drafter: plain AR
        p_1..p_{k+1} = model([tokens[-1], x_1..x_k])     # one full forward from the KV cache
        n, y = verify(x, p)                              # sampling.py
        tokens += x_1..x_n, y;  cache.rollback(len(tokens) - 1)

Plain autoregressive decoding is the same loop with no drafter, so the two are measured by
the same code. ``generate`` returns the new tokens and a ``DecodeStats``. One sequence's state is a
``Run`` (``propose`` the rows to verify, ``accept`` the logits for them), so the batched loop
(``scheduler.py``) advances several with the same code. A greedy run alone verifies a drafter's token
trees where it has them (``accept_tree``; ``tree.py``).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from knnssd.engine.spec import draft_policy
from knnssd.engine.model import tree, tree_pass
from knnssd.engine.model.attention import PREFILL_ROWS, reuse_unit
from knnssd.engine.model.cache import KVCache
from knnssd.engine.spec.drafters import Draft, Drafter
from knnssd.engine.model.forms import DecoderForm
from knnssd.engine.model.pass_costs import sequence_costs
from knnssd.engine.spec.sampling import Verdict, Warp, accept_greedy, accept_sampled, draw, probs
from knnssd.engine.spec.sequence import Sequence
from knnssd.engine.model.timing import sync


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
    draft_calls: int = 0  # steps that asked the drafter for tokens (its cost is paid per call)
    drafted_at: list[int] = field(default_factory=list)  # [j - 1]: steps that drafted j tokens or more
    accepted_at: list[int] = field(default_factory=list)  # [j - 1]: steps that accepted j tokens or more
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


@dataclass(frozen=True)
class Reused:
    """The first ``n`` positions of a prompt, already prefilled on another slot with the same tokens: that
    slot's cache (read after this prefill's reservation, which may regrow a pool's buffers) and the states
    its prefill returned for them (``prefill``'s third value, with the same ``tap``). ``n`` is what
    ``reusable`` allows, so the rest of the prompt gets the rows its own prefill from 0 would
    (``prefixes.Prefixes``; ``prefixes.prefix_exact`` checks the result is the same)."""

    n: int
    cache: KVCache
    states: torch.Tensor  # (n, E)
    tap: int | None


def reuse_unit_of(decoder) -> int:
    """``attention.reuse_unit`` for a decoder (its dtype, device, head size and step attention)."""
    return reuse_unit(decoder.stack.dtype, decoder.device, decoder.stack.head_dim, decoder.attention)


def reusable(common: int, length: int, unit: int) -> int:
    """The most leading positions a prompt of ``length`` tokens may take from another whose first
    ``common`` tokens are the same: a multiple of ``unit`` (``attention.reuse_unit``: where the rest's
    rows are those of a prefill from 0), leaving more than ``PREFILL_ROWS`` to compute (a shorter call
    is run as a verify pass)."""
    return max(0, min(common, length - PREFILL_ROWS - 1)) // unit * unit


class Prefill(Protocol):
    """``prefill``'s signature (``prefixes.Prefixes.prefill`` has it too)."""

    def __call__(self, decoder: DecoderForm, prompt_ids: list[int], config: GenerationConfig, tap: int | None = None
                 ) -> tuple[Sequence, torch.Tensor, torch.Tensor]: ...


def prefill(decoder: DecoderForm, prompt_ids: list[int], config: GenerationConfig, tap: int | None = None,
            reuse: Reused | None = None) -> tuple[Sequence, torch.Tensor, torch.Tensor]:
    """Run the prompt; returns the sequence, the last position's logits (V,) and the prompt's hidden
    states (T, E): final-normed, or the residual stream after layer ``tap`` when given. ``reuse``: copy
    its first positions' K/V and states instead of computing them."""
    if not prompt_ids:
        raise ValueError("empty prompt: at least one token is needed")
    if reuse is not None and (reuse.tap != tap or not 0 < reuse.n == reusable(reuse.n, len(prompt_ids),
                                                                                 reuse_unit_of(decoder))):
        raise ValueError(f"cannot reuse {reuse.n} positions (tap {reuse.tap}) for a prompt of "
                         f"{len(prompt_ids)} (tap {tap})")
    device = decoder.device
    gen = None
    if not config.warp.greedy:
        gen = torch.Generator(device=device)
        gen.manual_seed(config.seed if config.seed is not None else torch.seed())
    decoder.reserve(len(prompt_ids) + config.max_new_tokens)  # positions: the same for every drafter
    n = reuse.n if reuse is not None else 0
    if reuse is not None:
        decoder.cache.copy_from(reuse.cache, n)
    ids = torch.tensor(prompt_ids[n:], dtype=torch.long, device=device)
    out = decoder.forward(ids, n, last=True, tap=tap)
    states = out.hidden if out.tapped is None else out.tapped
    if reuse is not None:
        states = torch.cat([reuse.states, states])
    seq = Sequence(list(prompt_ids), len(prompt_ids), decoder, config.warp, gen, device)
    return seq, out.logits[0], states


@dataclass
class Call:
    """One sequence's rows of a full-model pass: its last token and its draft, from ``start``."""

    ids: torch.Tensor  # (1 + len(draft),)
    start: int
    draft: Draft | None

    @property
    def rows(self) -> int:
        return self.ids.shape[0]


class Run:
    """One sequence being decoded: ``propose`` drafts and returns the rows to verify, ``accept`` takes
    the full model's logits for them. ``loop`` runs one sequence with it; ``scheduler.decode_batch``
    runs several, verifying their rows in one pass."""

    def __init__(self, seq: Sequence, first_logits: torch.Tensor, drafter: Drafter | None, config: GenerationConfig,
                 tokenizer=None):
        self.seq, self.drafter, self.config = seq, drafter, config
        ex = seq.decoder.exactness
        self.stats = DecodeStats(prompt_tokens=seq.n_prompt, exact=bool(ex and ex.exact), step=ex.step if ex else "")
        self.stopper = _Stopper(config, tokenizer)
        self.max_draft = ex.max_t - 1 if ex else 1 << 30  # longer passes were not probed
        self.k = drafter.max_len if drafter is not None else 0  # draft length; the drafter's feedback adapts it
        self.goodput = drafter.goodput if drafter is not None else None  # cuts each draft to what pays
        self._offer: tuple[tuple[int, int], list[int], int] | None = None  # this step's: state, draft, kept
        self._last: tuple[int, int] | None = None  # (reached, accepted): how the last draft on offer fared
        # token trees where this sequence decodes alone and greedily, on a decoder that verifies them (tree.py)
        self.trees = drafter is not None and drafter.tree > 0 and config.warp.greedy and seq.decoder.can_tree
        warp = config.warp
        seq.last = (first_logits.argmax(-1) if warp.greedy else draw(probs(first_logits, warp), seq.generator)).view(1)
        first = int(seq.last)
        self.new = [first]
        seq.tokens.append(first)
        self.stats.stop = self.stopper.check(self.new)

    @property
    def done(self) -> bool:
        return bool(self.stats.stop)

    def draft_cap(self) -> int:
        """The longest draft this step may have: the drafter's own length, what could still be emitted,
        and what the exactness probe covered."""
        if self.drafter is None:
            return 0
        return draft_policy.cap(self.k, self.config.max_new_tokens - len(self.new), self.max_draft)

    def node_cap(self) -> int:
        """The most drafted nodes a token tree may have this step: the drafter's ``tree``, what the probe
        covered, and the reserved positions left (a pass writes node j's K/V at place start + j; 0 where this
        sequence drafts no tree now)."""
        if not self.trees or self.draft_cap() <= 0:
            return 0
        room = self.seq.decoder.cache.length - len(self.seq.tokens)
        return max(0, min(self.drafter.tree, self.max_draft, PREFILL_ROWS - 1, room))

    def propose(self, k: int | None = None, as_tree: bool = False, nodes: int | None = None) -> Call:
        """Draft up to ``k`` tokens (default ``draft_cap()``) and return the rows to verify; with ``as_tree``,
        a token tree up to ``k`` deep, of up to ``nodes`` drafted nodes (default ``node_cap()``)."""
        t0 = time.perf_counter()
        k = self.draft_cap() if k is None else min(k, self.draft_cap())
        if as_tree:
            nodes = self.node_cap() if nodes is None else min(nodes, self.node_cap())
        if k <= 0 or (as_tree and nodes <= 0):
            draft = None
        elif as_tree:
            draft = self.drafter.propose_tree(self.seq, k, nodes)
        else:
            draft = self.drafter.propose(self.seq, k)
        self.stats.draft_calls += draft is not None
        seq = self.seq
        ids = seq.last if draft is None else torch.cat((seq.last, draft.tokens))
        self.stats.draft_s += time.perf_counter() - t0
        return Call(ids, len(seq.tokens) - 1, draft)

    def priced(self, call: Call) -> Call:
        """``call`` with its chain draft cut to the length that pays (``draft_policy.Goodput``: 0, a plain step),
        where the drafter prices its drafts and this decoder's passes can be timed. The cut draft is a
        prefix of the draft, so the step verifies what a drafter of that length would have drafted."""
        g, draft = self.goodput, call.draft
        if g is None or draft is None or draft.parents is not None or draft.q is not None:
            return call
        costs = sequence_costs(self.seq.decoder)
        if costs is None:
            return call
        t0 = time.perf_counter()
        offered = draft.tokens.tolist()
        state = draft_policy.goodput_state(len(offered), self._last)
        kept = g.length(state, len(offered), costs)
        self._offer = state, offered, kept
        self.stats.draft_s += time.perf_counter() - t0  # the rule's time is the draft's
        if kept == len(offered):
            return call
        cut = Draft(draft.tokens[:kept]) if kept else None
        return Call(call.ids[: 1 + kept], call.start, cut)

    def accept(self, call: Call, logits: torch.Tensor) -> int:
        """Verify ``call``'s draft against the full model's ``logits`` (one row per id, or only the last
        when nothing was drafted), emit the accepted tokens and the next one, roll the cache back.
        Returns the number of tokens emitted."""
        return self.apply(Verdict.read(self.judge(call, logits)))  # the step's one host read

    def judge(self, call: Call, logits: torch.Tensor) -> torch.Tensor:
        """The packed verdict on ``call`` (``sampling.Verdict``), on the device: nothing is read yet."""
        x, draft, warp = call.ids[1:], call.draft, self.config.warp
        kept = draft.kept if draft is not None else None
        if warp.greedy:
            return accept_greedy(x, logits, kept)
        return accept_sampled(x, draft.q if draft is not None else None, probs(logits, warp), self.seq.generator, kept)

    def apply(self, verdict: Verdict) -> int:
        """Emit what ``verdict`` accepted and the next token; returns how many."""
        seq, stats = self.seq, self.stats
        seq.last = verdict.next_ids
        n = verdict.accepted
        stats.steps += 1
        stats.drafted += len(verdict.drafted)
        stats.accepted.append(n)
        draft_policy.add_at(stats.drafted_at, [1] * len(verdict.drafted))
        draft_policy.add_at(stats.accepted_at, [1] * n)
        if self.drafter is not None:
            self.k = self.drafter.next_len(self.k, verdict.reported_len, n)
        if self._offer is not None:
            state, offered, kept = self._offer
            self.goodput.observe(state, offered, kept, verdict.emitted)
            self._last, self._offer = draft_policy.verified(offered, kept, verdict.emitted), None
        before = len(self.new)
        for tok in verdict.emitted:
            self.new.append(tok)
            seq.tokens.append(tok)
            stats.stop = self.stopper.check(self.new)
            if stats.stop:
                break
        seq.decoder.rollback(len(seq.tokens) - 1)
        return len(self.new) - before

    def _complete_ahead(self, dec) -> tuple[list[int], DecodeStats]:
        """Plain greedy decoding with the device one step ahead of the host: step t+1 is launched on step t's
        token while that is still on the device, and step t's token is read and checked for a stop while
        step t+1 runs, so the host's work per token overlaps the device's. A step launched past a stop
        writes K/V past the sequence's end, which a ``runs_ahead`` decoder masks and later overwrites (its
        ``rollback`` must never discard positions: ``apply`` rolls back to a position step t+1 already
        wrote); none is launched past ``max_new_tokens``."""
        pending = None  # the launched step not yet read: (its reader, its token on the device)
        start = len(self.seq.tokens) - 1  # the position of the token the next step reads
        while not self.done:
            t1 = time.perf_counter()
            ahead = None
            if len(self.new) + (pending is not None) < self.config.max_new_tokens:
                ids = self.seq.last if pending is None else pending[1]
                packed = self.judge(Call(ids, start, None), dec.forward(ids, start, last=True).logits)
                ahead, start = (Verdict.read_later(packed), Verdict.next_of(packed)), start + 1
            if pending is not None:
                self.apply(pending[0]())
            elif ahead is None:
                break  # nothing launched and nothing to read: the stopper ends the run at max_new_tokens
            pending = ahead
            self.stats.verify_s += time.perf_counter() - t1
        return self.finish()

    def finish(self) -> tuple[list[int], DecodeStats]:
        """The new tokens and the stats (``new_tokens`` set); the drafter hears that the sequence ended."""
        self.stats.new_tokens = len(self.new)
        if self.drafter is not None:
            self.drafter.finish(self.seq)
        return self.new, self.stats

    def complete(self) -> tuple[list[int], DecodeStats]:
        """Decode this sequence alone to its end: one full-model pass on its decoder per step."""
        dec = self.seq.decoder
        if self.drafter is None and self.config.warp.greedy and dec.runs_ahead:
            return self._complete_ahead(dec)
        while not self.done:
            call = self.priced(self.propose(as_tree=self.trees))
            t1 = time.perf_counter()
            if call.draft is not None and call.draft.parents is not None:
                self.accept_tree(call)
            else:
                self.accept(call, dec.forward(call.ids, call.start, last=call.rows == 1).logits)
            self.stats.verify_s += time.perf_counter() - t1
        return self.finish()

    def accept_tree(self, call: Call) -> int:
        """Verify a token tree in one pass, keep its accepted path's K/V and emit (greedy; ``tree.py``)."""
        dec, parents = self.seq.decoder, call.draft.parents
        out, kv = tree_pass.forward_tree(dec, call.ids, call.start, parents)
        verdict = tree.accept_greedy(call.draft.host, parents, out.logits)
        tree_pass.settle(dec, call.start, kv, verdict.path)
        return self.apply(verdict)


def decode(
    seq: Sequence, first_logits: torch.Tensor, drafter: Drafter | None, config: GenerationConfig, tokenizer=None
) -> tuple[list[int], DecodeStats]:
    """Continue a prefilled sequence until EOS, max_new_tokens or a stop string."""
    return Run(seq, first_logits, drafter, config, tokenizer).complete()


def generate(
    decoder: DecoderForm, prompt_ids: list[int], drafter: Drafter | None = None,
    config: GenerationConfig = GenerationConfig(),
    tokenizer=None,
) -> tuple[list[int], DecodeStats]:
    """Generate from ``prompt_ids``; returns (new tokens, stats). Greedy output equals plain greedy decoding."""
    t0 = time.perf_counter()
    seq, logits, _ = prefill(decoder, prompt_ids, config)
    sync(decoder.device)  # a GPU prefill ends here, not inside the first decode step
    t1 = time.perf_counter()
    new, stats = decode(seq, logits, drafter, config, tokenizer)
    stats.prefill_s = t1 - t0
    stats.total_s = time.perf_counter() - t0
    return new, stats
