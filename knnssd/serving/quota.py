"""Per-key caps on ``knnssd serve``: requests running at once, and tokens a minute (``--key-concurrency``,
``--key-tokens-per-minute``). A request over either cap gets a 429 with ``Retry-After`` before it takes a slot.

A key is one of the server's API keys (``access.RequireKey`` names it by its place among them); a server without
keys holds every client to one shared cap. Tokens are charged as a request is admitted: its ``max_tokens``, since
its prompt is not yet tokenized; as it ends the charge becomes what it used, prompt and completion tokens. A charge
counts for 60 s from its admission (a sliding window, as OpenAI's tokens-per-minute limits).

Everything here runs on the server's event loop: no lock.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0


class OverCap(Exception):
    """A request over its key's cap: ``retry_after_s``, whole seconds until it would be admitted; ``kind``, the
    cap ("requests" or "tokens", as OpenAI's 429s name theirs)."""

    def __init__(self, message: str, retry_after_s: int, kind: str):
        super().__init__(message)
        self.retry_after_s, self.kind = retry_after_s, kind


@dataclass(frozen=True)
class Caps:
    concurrent: int | None = None  # requests of one key running or queued at once
    tokens_per_minute: int | None = None  # prompt and completion tokens of one key in any 60 s

    def __bool__(self) -> bool:
        return self.concurrent is not None or self.tokens_per_minute is not None


@dataclass
class Lease:
    """One admitted request's place under its key's caps; ``end`` gives it back (once)."""

    quotas: "Quotas"
    key: str
    charge: list = field(default_factory=lambda: [0.0, 0])  # [admitted at, tokens], an entry of the key's window
    ended: bool = False

    def end(self, used_tokens: int | None = None) -> None:
        """The request is over: its place is free (once), and its charge becomes ``used_tokens`` (None: as it
        stands)."""
        if used_tokens is not None:
            self.charge[1] = used_tokens
        if not self.ended:
            self.ended = True
            self.quotas.running[self.key] -= 1


class Quotas:
    def __init__(self, caps: Caps, clock=time.monotonic):
        self.caps, self.clock = caps, clock
        self.running: dict[str, int] = {}
        self.charges: dict[str, deque] = {}

    def take(self, key: str, tokens: int) -> Lease:
        """Admit a request of ``key`` that may use ``tokens`` (its ``max_tokens``), or raise ``OverCap``."""
        caps, now = self.caps, self.clock()
        running = self.running.get(key, 0)
        if caps.concurrent is not None and running >= caps.concurrent:
            raise OverCap(f"this API key has {running} requests running, its cap (--key-concurrency "
                          f"{caps.concurrent}); retry when one ends", 1, "requests")
        charges = self.charges.setdefault(key, deque())
        while charges and charges[0][0] <= now - WINDOW_S:
            charges.popleft()
        if caps.tokens_per_minute is not None:
            cap = caps.tokens_per_minute
            if tokens > cap:
                raise OverCap(f"this request may make {tokens} tokens (its max_tokens, or the default), more than this "
                              f"API key's {cap} tokens a minute (--key-tokens-per-minute); set max_tokens lower",
                              math.ceil(WINDOW_S), "tokens")
            spent = sum(n for _, n in charges)
            if spent + tokens > cap:
                raise OverCap(f"this API key has used {spent} of its {cap} tokens a minute "
                              f"(--key-tokens-per-minute); this request may use {tokens} more",
                              self._until_room(charges, spent + tokens - cap, now), "tokens")
        self.running[key] = running + 1
        charge = [now, tokens]
        charges.append(charge)
        return Lease(self, key, charge)

    @staticmethod
    def _until_room(charges: deque, over: int, now: float) -> int:
        """Whole seconds until charges of at least ``over`` tokens have left the window (oldest first)."""
        freed = 0
        for t, n in charges:
            freed += n
            if freed >= over:
                return max(1, math.ceil(t + WINDOW_S - now))
        return math.ceil(WINDOW_S)  # charges of running requests may settle lower: a minute at most
