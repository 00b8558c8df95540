"""A header-read deadline for uvicorn's HTTP protocols (slow-header attacks).

uvicorn times out idle keep-alive connections but not a request whose headers arrive a byte at
a time, so a few dozen slow clients could hold connections for minutes. These subclasses of
uvicorn's two HTTP/1.1 protocols close a connection whose request headers are not complete
within `header_timeout_s` of the connection opening or of the request's first byte. The body
is not under this deadline (a large upload on a slow link is legitimate; `max_body_bytes`
bounds it).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderDeadline:
    """Mixin: one timer per connection, armed while a request's headers are incomplete."""

    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


class H11HeaderDeadline(_HeaderDeadline, H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # headers parsed: the body is not timed
            self._disarm_header_deadline()
        elif self.conn.trailing_data[0]:  # part of the next request's headers
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)


def _httptools_class() -> type[asyncio.Protocol] | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is optional
        return None

    class HttpToolsHeaderDeadline(_HeaderDeadline, HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_deadline()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_deadline()

        def on_headers_complete(self) -> None:
            self._disarm_header_deadline()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_deadline()
            super().connection_lost(exc)

    return HttpToolsHeaderDeadline


def http_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's `http=` class with the header deadline (httptools when installed, like
    uvicorn's "auto", else h11)."""
    base: Any = _httptools_class() or H11HeaderDeadline
    cls: type[asyncio.Protocol] = type(base.__name__, (base,),
                                       {"header_timeout_s": header_timeout_s})
    return cls


#: For uvicorn's own command line, which takes a class by import path: `uvicorn --factory
#: seedfed.server.app:app_from_env --http seedfed.server.connections:HeaderDeadlineProtocol`
#: (the default 10 s; `seedfed coordinator` applies `Settings.header_timeout_s`).
HeaderDeadlineProtocol = http_protocol(10.0)
