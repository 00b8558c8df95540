"""Connection guards for uvicorn's HTTP protocols: slow clients cannot hold connections.

uvicorn times out idle keep-alive connections, but not a request whose headers arrive a byte at
a time, nor one whose body stops arriving, so a few dozen slow clients could hold connections
for as long as they like. The subclasses of uvicorn's two HTTP/1.1 protocols built here
(`http_protocol`) add three guards:

- **Header deadline.** A request's headers must be complete within `header_timeout_s` of the
  connection opening or of the request's first byte; otherwise the connection is closed.
- **Body progress.** While the coordinator waits for a request's body, a connection that sends
  nothing for `body_timeout_s` is answered 408 (`ErrorBody`, `Connection: close`) and closed.
  Time during which the coordinator itself is not reading (its buffer is full, or the client
  waits for `100 Continue`) does not count: only the client's own silence does. A large upload
  on a slow link is legitimate as long as it keeps moving (`max_body_bytes` bounds its size).
  A request answered before its body ended is closed after its answer (nothing reads the
  rest).
- **Anonymous connections.** A connection is anonymous until one of its requests presents a
  credential the coordinator accepted (a device token or the admin token: the app calls
  `trust(scope)`). At most `max_anonymous` anonymous connections are open at once; a new one
  beyond that closes the oldest anonymous connection. Evicting the oldest, not refusing the
  newest, keeps a flood from locking out newcomers: an honest device authenticates with its
  first request's headers, within milliseconds, so only connections that stay anonymous
  (stalled or trickling ones) are in the way long enough to be evicted.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from seedfed.server.errors import RequestTimeoutError, error_payload
from starlette.types import Scope
from uvicorn.protocols.http.h11_impl import H11Protocol

#: The key of a request's connection in its ASGI scope's "extensions".
SCOPE_KEY = "seedfed.connection"

_TIMEOUT_BODY = error_payload("the request body stopped arriving: nothing was received for "
                              "the coordinator's body_timeout_s; send the body without pauses",
                              RequestTimeoutError.__name__)
_TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                   b"content-length: " + str(len(_TIMEOUT_BODY)).encode() +
                   b"\r\nconnection: close\r\n\r\n" + _TIMEOUT_BODY)


class AnonymousConnections:
    """The open connections of one server that have not authenticated a request, oldest
    first, at most `cap` of them."""

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError(f"the anonymous connection cap must be >= 1, got {cap}")
        self.cap = cap
        self._open: dict[int, _Guards] = {}  # insertion order = age
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._open)

    def opened(self, conn: _Guards) -> None:
        self._open[id(conn)] = conn
        while len(self._open) > self.cap:
            oldest = self._open.pop(next(iter(self._open)))
            self.evicted += 1
            oldest._close()

    def left(self, conn: _Guards) -> None:
        self._open.pop(id(conn), None)


def trust(scope: Scope) -> None:
    """Mark the connection of a request whose credential was accepted as authenticated (it no
    longer counts against the anonymous cap). A no-op outside the guarded protocols (tests'
    in-process clients, other servers)."""
    conn = scope.get("extensions", {}).get(SCOPE_KEY)
    if conn is not None:
        conn.trust()


class _Guards(asyncio.Protocol):
    """Mixin over a uvicorn HTTP protocol (listed before it, so `super()` reaches the
    protocol): the three guards of the module docstring."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    anonymous: AnonymousConnections | None = None
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _body_seen_at: float = 0.0
    _trusted: bool = False
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    flow: Any

    # -- connection life -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()
        if self.anonymous is not None:
            self.anonymous.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self.anonymous is not None:
            self.anonymous.left(self)
        super().connection_lost(exc)

    def trust(self) -> None:
        if not self._trusted:
            self._trusted = True
            if self.anonymous is not None:
                self.anonymous.left(self)

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _tag(self, scope: dict[str, Any]) -> None:
        """Put this connection in a request's scope, so the app can `trust` it."""
        scope.setdefault("extensions", {})[SCOPE_KEY] = self

    # -- header deadline ---------------------------------------------------------------------
    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        self._close()

    # -- body progress -----------------------------------------------------------------------
    def _awaiting_body(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return (cycle is not None and cycle.more_body and not cycle.response_complete
                and not cycle.disconnected and not self.transport.is_closing())

    def _body_progress(self) -> None:
        """After data arrived or a response completed: (re)start or stop the body clock; and
        close a connection whose request was answered before its body ended (nobody reads the
        rest, and reading it to reach a next request would let a client trickle forever)."""
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle.response_complete and cycle.more_body:
            self._close()  # after the answer: close() sends what is buffered first
        if not self._awaiting_body():
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            return
        self._body_seen_at = self.loop.time()
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_check)

    def _body_check(self) -> None:
        self._body_timer = None
        if not self._awaiting_body():
            return
        now = self.loop.time()
        if self.flow.read_paused or getattr(self.cycle, "waiting_for_100_continue", False):
            self._body_seen_at = now  # the coordinator is not reading: not the client's delay
        idle = now - self._body_seen_at
        if idle < self.body_timeout_s:
            self._body_timer = self.loop.call_later(self.body_timeout_s - idle, self._body_check)
            return
        cycle = self.cycle
        if not cycle.response_started:
            cycle.response_started = True
            self.transport.write(_TIMEOUT_ANSWER)
        cycle.disconnected = True  # the app's receive() now returns http.disconnect
        cycle.message_event.set()
        self._close()


class H11Guarded(_Guards, H11Protocol):
    """uvicorn's h11 protocol with the guards."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # headers parsed: the body clock takes over
            self._disarm_header_deadline()
        elif self.conn.trailing_data[0]:  # part of the next request's headers
            self._arm_header_deadline()
        self._body_progress()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None:  # a request just parsed has not started running yet
            self._tag(self.cycle.scope)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._body_progress()



def _httptools_class() -> type[asyncio.Protocol] | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is optional
        return None

    class HttpToolsGuarded(_Guards, HttpToolsProtocol):
        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._body_progress()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_deadline()
            self._tag(self.scope)  # type: ignore[arg-type]

        def on_headers_complete(self) -> None:
            self._disarm_header_deadline()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._body_progress()

    return HttpToolsGuarded


def http_protocol(header_timeout_s: float, body_timeout_s: float = 30.0,
                  max_anonymous: int | None = None) -> type[asyncio.Protocol]:
    """uvicorn's `http=` class with the guards (httptools when installed, like uvicorn's
    "auto", else h11). Each call makes a class of its own, with its own anonymous cap (None:
    no cap), so one class serves one server."""
    base: Any = _httptools_class() or H11Guarded
    cls: type[asyncio.Protocol] = type(base.__name__, (base,), {
        "header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
        "anonymous": None if max_anonymous is None else AnonymousConnections(max_anonymous)})
    return cls


#: For uvicorn's own command line, which takes a class by import path: `uvicorn --factory
#: seedfed.server.app:app_from_env --http seedfed.server.connections:HeaderDeadlineProtocol`
#: (the Settings defaults; `seedfed coordinator` applies the coordinator's settings).
HeaderDeadlineProtocol = http_protocol(10.0, 30.0, 1024)
