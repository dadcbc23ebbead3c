"""Connections ``knnssd serve`` will not keep: one whose request head does not arrive in time (``with_head_deadline``).

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
