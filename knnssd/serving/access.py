"""Who may use ``knnssd serve``: its API keys (``Keys``), asked for on every ``/v1/*`` request and on ``/metrics``
from beyond loopback (``RequireKey``), and the addresses a server may bind without any (``loopback``).

A client sends ``Authorization: Bearer <key>``, as OpenAI's clients do with ``api_key=``. A missing or wrong key
gets a 401 in OpenAI's error shape before the body is read. The keys are compared by their SHA-256 digests with
``hmac.compare_digest``, against every key whatever the first comparisons gave, so neither the time of an answer
nor its length tells a client how much of a key it had right. The keys themselves are not kept, logged or
counted in ``/metrics``.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

ENV = "KNNSSD_API_KEY"  # a key from the environment, as vLLM's VLLM_API_KEY: not in the process list
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _checked(key: str, where: str) -> str:
    if not key or any(c.isspace() for c in key) or not key.isprintable():
        raise ValueError(f"{where}: an API key must be one word of printable characters, with no spaces")
    return key


@dataclass(frozen=True)
class Keys:
    """The API keys a server takes (none: it asks for none)."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def gather(cls, given: list[str] | None = None, file: str | None = None, env: dict | None = None) -> "Keys":
        """``--api-key`` (repeatable), ``KNNSSD_API_KEY``, and ``--api-key-file``: one key a line, blank lines and
        lines that start with ``#`` left out (several, so that a new key can be given out before an old one is
        taken back). A bad key or an unreadable or keyless file: a one-line ``ValueError``."""
        keys = [_checked(k, "--api-key") for k in given or ()]
        from_env = (os.environ if env is None else env).get(ENV)
        if from_env:
            keys.append(_checked(from_env, ENV))
        if file is not None:
            try:
                lines = Path(file).read_text().splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--api-key-file {file}: cannot read it ({type(e).__name__})") from None
            found = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
            if not found:
                raise ValueError(f"--api-key-file {file}: it holds no key (one a line; # starts a comment)")
            keys += [_checked(k, f"--api-key-file {file}") for k in found]
        return cls(tuple(dict.fromkeys(_digest(k) for k in keys)))

    def __bool__(self) -> bool:
        return bool(self.digests)

    def which(self, authorization: str | None) -> int | None:
        """Which of the keys an ``Authorization`` header's value carries (``Bearer <key>``): its place among
        them, or None."""
        scheme, _, key = (authorization or "").strip().partition(" ")
        given = _digest(key.strip())
        found = None
        for i, d in enumerate(self.digests):  # every key compared, in constant time each
            if hmac.compare_digest(given, d):
                found = i
        return found if scheme.lower() == "bearer" else None

    def admits(self, authorization: str | None) -> bool:
        return self.which(authorization) is not None


def loopback(host: str) -> bool:
    """Is ``host`` an address only this machine reaches (127.0.0.0/8, ::1, localhost)?"""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address


def bind_error(host: str, keys: Keys, insecure: bool) -> str | None:
    """Why a server may not bind ``host`` as asked (one line), or None: beyond loopback, only with a key or
    ``--insecure-no-auth``."""
    if keys or insecure or loopback(host):
        return None
    return (f"--host {host} lets other machines in, and no API key is set: give --api-key (or {ENV}, or "
            "--api-key-file), or --insecure-no-auth if anyone who reaches it may use it")


class RequireKey:
    """A plain ASGI layer: a request to ``/v1/*``, or to ``/metrics`` from beyond loopback unless
    ``metrics_open``, without one of ``keys`` is answered by ``refuse(missing)`` (an ASGI app: a 401; ``missing``:
    no ``Authorization`` header at all) and goes no further. One with a key goes on with the key's name
    (``key_name``) in ``scope["state"]["api_key"]``, for its caps (``quota``)."""

    def __init__(self, inner, keys: Keys, refuse, metrics_open: bool = False):
        self.inner, self.keys, self.refuse, self.metrics_open = inner, keys, refuse, metrics_open

    def guarded(self, scope) -> bool:
        path = scope.get("path", "")
        if path == "/v1" or path.startswith("/v1/"):
            return True
        if path.rstrip("/") == "/metrics":
            client = scope.get("client")
            return not (self.metrics_open or (client is not None and loopback(str(client[0]))))
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and self.guarded(scope):
            given = dict(scope.get("headers") or ()).get(b"authorization")
            which = self.keys.which(given.decode("latin-1") if given is not None else None)
            if which is None:
                return await self.refuse(given is None)(scope, receive, send)
            scope.setdefault("state", {})["api_key"] = key_name(which)
        await self.inner(scope, receive, send)


def key_name(which: int | None) -> str:
    """How caps and logs name a key: its place among the server's keys from 1 (never the key); without keys,
    every client is "anonymous"."""
    return "anonymous" if which is None else f"key {which + 1}"
