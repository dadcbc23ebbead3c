"""Connections ``knnssd serve`` will not keep: one whose request head does not arrive in time (``with_head_deadline``),
and bodies it will not read past a bound (``BoundedBody``).

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


def with_head_deadline(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol (``uvicorn.Config(http=...)``) with a deadline of ``seconds`` for each request head."""

    class HeadDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_after: object = None  # the cycle the awaited head comes after (None: the connection's first)

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
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
    grace period of a shutdown (``stopping``) ends here quietly, its handler having told its client."""

    def __init__(self, inner, most: int, too_large, stopping):
        self.inner, self.most, self.too_large, self.stopping = inner, most, too_large, stopping

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            # the body is read here, up to the bound, whether or not a Content-Length announced it (a chunked
            # body has none); the rest is read and dropped, so a client still sending gets the 413
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
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
        try:
            await self.inner(scope, receive, send)
        except asyncio.CancelledError:
            if not self.stopping():
                raise
            # past the grace period: the handler has told its client (an error event, or 503); ending here
            # keeps uvicorn from logging the cancellation as a failed application
