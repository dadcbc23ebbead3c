"""Connections ``knnssd serve`` will not keep: one whose request head does not arrive in time (``with_head_deadline``),
requests past a cap on open connections (``ConnectionCap``), and bodies it will not read past a bound
(``BoundedBody``).

uvicorn's h11 protocol arms a timer only between requests (``--timeout-keep-alive``), and a client that sends a
byte of its request disarms it, so a client that sends its head a byte at a time holds its socket for as long as
it likes; 200 such clients held 200 sockets for 70 s in a hostile trial. Here each request's head (its request
line and headers) must arrive within the deadline from the connection's start, or from the end of the previous
response on a kept-alive connection; otherwise the connection is closed. A request whose head has arrived is
not cut: its body and its answer (a long stream) take what they take.
"""
from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def with_head_deadline(seconds: float, counted: set | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol (``uvicorn.Config(http=...)``) with a deadline of ``seconds`` for each request head;
    each open connection is in ``counted`` while it is open (for ``ConnectionCap``)."""

    class HeadDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_after: object = None  # the cycle the awaited head comes after (None: the connection's first)

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if counted is not None:
                counted.add(self)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._waiting_after:  # a head arrived whole
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._deadline is None:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if counted is not None:
                counted.discard(self)
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._waiting_after = self.cycle
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline


class BoundedBody:
    """A plain ASGI layer (Starlette's middleware class hides a client's disconnect from handlers): a POST body
    over ``most`` bytes is answered by ``too_large`` (an ASGI app: a 413), and a request cancelled past the
    grace period of a shutdown (``stopping``) ends here quietly, its handler having told its client. A POST body
    is read as JSON whatever its ``Content-Type`` says: the API takes nothing else, and ``curl -d`` sends JSON
    as a form (trial 6, D1: a valid body without the header was "not a JSON object"). A body that stops coming
    for ``idle_s`` is answered by ``too_slow`` (a 408): the head's deadline does not cover it, and a client
    that announced more than it sent held its connection (trial 6)."""

    def __init__(self, inner, most: int, too_large, stopping, idle_s: float | None = None, too_slow=None):
        self.inner, self.most, self.too_large, self.stopping = inner, most, too_large, stopping
        self.idle_s, self.too_slow = idle_s, too_slow

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            # the body is read here, up to the bound, whether or not a Content-Length announced it (a chunked
            # body has none); the rest is read and dropped, so a client still sending gets the 413
            chunks, size, more = [], 0, True
            while more:
                try:
                    message = await asyncio.wait_for(receive(), self.idle_s)
                except asyncio.TimeoutError:
                    return await self.too_slow()(scope, receive, send)
                if message["type"] != "http.request":
                    return  # the client went away
                more = message.get("more_body", False)
                size += len(message.get("body", b""))
                if size <= self.most:
                    chunks.append(message.get("body", b""))
            if size > self.most:
                return await self.too_large()(scope, receive, send)
            replayed = False

            async def receive_body(receive=receive):
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

            receive = receive_body
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        try:
            await self.inner(scope, receive, send)
        except asyncio.CancelledError:
            if not self.stopping():
                raise
            # past the grace period: the handler has told its client (an error event, or 503); ending here
            # keeps uvicorn from logging the cancellation as a failed application


class ConnectionCap:
    """A plain ASGI layer: a request that arrives while more than ``most`` connections are open (``counted`` by
    ``with_head_deadline``'s protocol) is answered by ``busy(n)`` (an ASGI app: a 503 in OpenAI's shape, with
    Retry-After, counted in /metrics), where uvicorn's own cap answered plain text (trial 6, D3)."""

    def __init__(self, inner, counted: set, most: int, busy):
        self.inner, self.counted, self.most, self.busy = inner, counted, most, busy

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(self.counted) > self.most:
            return await self.busy(len(self.counted))(scope, receive, send)
        await self.inner(scope, receive, send)
