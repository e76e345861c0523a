"""A deadline for a request's headers, against slow clients (slowloris).

uvicorn limits idle keep-alive connections but not a client that sends its headers a byte at a
time: every such connection holds a socket and a slot forever. This protocol closes a connection
whose request headers are not complete `seconds` after their first byte (or after the connection
opened). The body has its own limit in the app (`ServerSettings.body_timeout_seconds`).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """An H11Protocol class for `uvicorn.Config(http=...)` with a `seconds` header deadline."""

    class HeaderTimeoutProtocol(H11Protocol):
        header_timeout = seconds

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

        def data_received(self, data: bytes) -> None:
            waiting_for_headers = self.conn.their_state is h11.IDLE
            if waiting_for_headers and getattr(self, "_header_timer", None) is None:
                # the next request on a kept-alive connection: its headers get the same deadline
                self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE and self._header_timer is not None:
                self._header_timer.cancel()  # headers complete: the request is being handled
                self._header_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection whose request headers took over %.1f s", self.header_timeout)
                self.transport.close()

    return HeaderTimeoutProtocol
