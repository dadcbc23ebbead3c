"""What one generation request asks for (``GenerateParams``), what one sequence may hold (``Limits``:
the model's context and the KV-cache memory budget), how many sequences a batch may decode together
(``batch_size``), and the two prompt policies: the CLI's, batch generation's and the pyfunc server's
(checked, tokenized, truncated to its last tokens, ``prompt_ids``) and the OpenAI server's (the whole
prompt, or an error, ``whole_prompt_ids``)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, fields

from knnssd.engine.model.cache import KVCache
from knnssd.engine.spec.sampling import Warp

log = logging.getLogger(__name__)


MAX_STOPS, MAX_STOP_CHARS = 16, 256  # each new token decodes a window as long as the longest stop string


@dataclass(frozen=True)
class GenerateParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_prompt_tokens: int = 4096  # longer prompts keep their last tokens (with a warning)
    stop: tuple[str, ...] = ()  # generation ends with the token that completes one of these

    def __post_init__(self):
        if not (isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOPS
                and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)):
            raise ValueError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
                             f"{MAX_STOP_CHARS} characters, got {self.stop!r:.80}")
        for s in self.stop:  # a lone surrogate: no generated text can contain it, as no prompt may
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"stop is not valid UTF-8 text: {s!r:.40}") from None
        for name in ("max_new_tokens", "top_k", "max_prompt_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:  # what a torch generator takes: 64 bits
            raise ValueError(f"seed must be in [0, 2**64) (or -1: a random one), got {self.seed}")
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
        if "stop" in d:  # OpenAI's form: one string or a list of them
            d["stop"] = (d["stop"],) if isinstance(d["stop"], str) else tuple(d["stop"]) if isinstance(
                d["stop"], list) else d["stop"]
        if d.get("seed") == -1:  # -1: a random seed (the signature's default); other negatives are refused
            del d["seed"]
        return cls(**d)


KV_MEMORY = 4 << 30  # bytes of KV cache that one sequence, or the slots of a batch together, may hold


@dataclass(frozen=True)
class Limits:
    """What one sequence of a model may hold: ``context`` positions (the model's
    ``max_position_embeddings``; None: the config names none) and ``memory`` bytes of KV cache at
    ``kv_bytes`` a position. A request is checked against them before any work starts, since the
    cache of a sequence that passes them is allocated whole (a billion new tokens asked for tried to
    allocate 384 GB after the model had loaded)."""

    context: int | None
    kv_bytes: int
    memory: int = KV_MEMORY
    cap: int | None = None  # a server's own bound (``knnssd serve --max-model-len``)

    @property
    def positions(self) -> int:
        """The most positions (prompt and new tokens) one sequence may take."""
        by_memory = self.memory // max(1, self.kv_bytes)
        most = by_memory if self.context is None else min(self.context, by_memory)
        return most if self.cap is None else min(most, self.cap)

    def bound(self) -> str:
        """What ``positions`` is set by, in words."""
        if self.positions == self.cap:
            return f"the server's --max-model-len of {self.cap} tokens"
        if self.positions == self.context:
            return f"the model's context of {self.context} tokens"
        return f"the {self.memory / 2**30:g} GiB KV-cache budget of one sequence ({self.positions} positions)"

    def check(self, params: "GenerateParams") -> None:
        """A one-line ``ValueError`` when ``max_new_tokens`` leaves no room for a prompt."""
        if params.max_new_tokens >= self.positions:
            raise ValueError(f"max_new_tokens ({params.max_new_tokens}) must be below {self.bound()}, "
                             "which also holds the prompt")

    def check_slots(self, slots: int, positions: int, name: str) -> None:
        """A batch size asked for (``name``: the option) within the budget, from the config alone: each of
        ``slots`` sequences takes at least ``positions``, at the model's dtype. A cache kept wider than the
        model (some steps keep fp32 K/V) holds fewer: ``plan.check_slots`` counts the real one."""
        most = max(1, self.memory // (self.kv_bytes * KVCache.bucket(positions)))
        if slots > most:
            raise too_many_slots(name, slots, most, positions, self.memory)

    def prompt_tokens(self, params: "GenerateParams") -> int:
        """The most prompt tokens kept: ``max_prompt_tokens``, or fewer where the prompt and
        ``max_new_tokens`` would not fit. ``params`` are checked once a request, by its caller (``check``)."""
        kept = min(params.max_prompt_tokens, self.positions - params.max_new_tokens)
        if kept < 1:  # a caller that did not check: its error, not a slice ``ids[-0:]`` that keeps the whole prompt
            self.check(params)
        return kept


def too_many_slots(name: str, slots: int, most: int, positions: int, memory: int = KV_MEMORY) -> ValueError:
    return ValueError(f"{name} {slots} is more than the {most} sequences of {positions} positions whose KV cache "
                      f"fits the {memory / 2**30:g} GiB budget")


def batch_size(text: str, name: str = "--batch-size") -> int | None:
    """A batch size as typed (``--batch-size``, ``$KNNSSD_BATCH_SIZE``): ``auto`` (None) or an integer
    >= 1; a one-line error naming ``name`` otherwise."""
    text = str(text).strip()
    if text == "auto":
        return None
    try:
        return check_batch_size(int(text), name)
    except ValueError:
        raise ValueError(f"{name} must be 'auto' or an integer >= 1, got '{text}'") from None


def check_batch_size(n, name: str = "batch size") -> int | None:
    """The one rule for a batch size once parsed (a request's, a run's): None (auto) or an integer >= 1."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{name} must be 'auto' or an integer >= 1, got {n!r}")
    return n


def _number(name: str, v):
    """Integral floats (JSON 8.0) become ints; NaN and inf stay floats, for the checks to name."""
    if isinstance(v, float) and v.is_integer() and name in ("max_new_tokens", "top_k", "max_prompt_tokens", "seed"):
        return int(v)
    return v


def check_prompt(prompt, where: str = "prompt") -> None:
    """A one-line ``ValueError`` for a prompt no model can take: not text, not UTF-8, or blank. ``where``: what the
    caller calls it, first in the message ("messages" for a chat's rendered prompt: the API names that field)."""
    if prompt is None or (isinstance(prompt, float) and prompt != prompt):  # JSON null (NaN in a pandas column)
        raise ValueError(f"{where} must be text, got null")
    if not isinstance(prompt, str):
        raise ValueError(f"{where} must be text, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} {'are' if where == 'messages' else 'is'} not valid UTF-8 text") from None
    if not prompt.strip():
        raise ValueError("empty prompt")


class ContextTooLong(ValueError):
    """A prompt the OpenAI server will not cut (``whole_prompt_ids``): ``param`` is what the request should
    change, ``prompt`` (or ``messages``) or ``max_tokens``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def whole_prompt_ids(tokenizer, prompt: str, params: GenerateParams, limits: Limits, fit: bool, where: str = "prompt"
                     ) -> tuple[list[int], GenerateParams]:
    """The OpenAI server's prompt policy (OpenAI's): token ids of the whole ``prompt`` and the params to run it
    with, never a prompt's tail. ``fit``: the request set no ``max_tokens``, so ``params.max_new_tokens`` (the
    default) is lowered to what the context leaves. ``ContextTooLong`` where the prompt is over
    ``max_prompt_tokens`` (what the server's slots are planned for: ``Batcher.prompt_tokens``) or it and the
    new tokens do not fit ``limits`` (``check_fits``). ``where``: the request's name for the prompt."""
    check_prompt(prompt, where)
    ids = tokenizer(prompt).input_ids
    n = len(ids)
    if n > params.max_prompt_tokens:
        raise ContextTooLong(f"the {where} {'take' if where == 'messages' else 'takes'} {n} tokens, more than the "
                             f"{params.max_prompt_tokens} a prompt may take here: shorten the {where}", where)
    if fit:
        params = dataclasses.replace(params, max_new_tokens=max(1, min(params.max_new_tokens, limits.positions - n)))
    check_fits(n, params, limits, where, fit)
    return ids, params


def check_fits(n: int, params: GenerateParams, limits: Limits, where: str = "prompt", fit: bool = False) -> None:
    """``ContextTooLong`` where a prompt of ``n`` tokens and ``params.max_new_tokens`` do not fit ``limits``
    (``fit``: the new tokens were lowered to fit already, so the prompt is what to change)."""
    if n + params.max_new_tokens > limits.positions:
        raise ContextTooLong(f"this request needs {n} tokens of {where} and {params.max_new_tokens} of completion, "
                             f"more than {limits.bound()}: shorten the {where}" + ("" if fit else
                                                                                    " or ask for fewer tokens"),
                             where if fit else "max_tokens")


def prompt_ids(tokenizer, prompt: str, params: GenerateParams, limits: Limits | None = None) -> tuple[list[int], bool]:
    """Token ids of ``prompt``, keeping the last ``limits.prompt_tokens(params)`` of a longer one
    (``max_prompt_tokens`` without ``limits``; warned); True if truncated. The prompt policy of ``generate``,
    ``complete`` and the pyfunc server (the OpenAI server refuses instead: ``whole_prompt_ids``). Each of them
    checks the prompt once, before any model loads (``check_prompt``): it is not checked again here."""
    limit = limits.prompt_tokens(params) if limits is not None else params.max_prompt_tokens
    ids = tokenizer(prompt).input_ids
    if len(ids) > limit:
        why = "" if limit == params.max_prompt_tokens else f" (the most that fits with {params.max_new_tokens} new tokens)"
        log.warning("prompt of %d tokens truncated to its last %d%s", len(ids), limit, why)
        return ids[-limit:], True
    return ids, False
