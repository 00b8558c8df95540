"""The header-read deadline: a client that sends its headers too slowly is dropped."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from seedfed.server.connections import H11HeaderDeadline, http_protocol


async def hello(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _protocols() -> list[type[asyncio.Protocol]]:
    timed = type("H11Fast", (H11HeaderDeadline,), {"header_timeout_s": 0.3})
    return [timed, http_protocol(0.3)]


@pytest.fixture(params=_protocols(), ids=lambda c: c.__mro__[1].__name__)
def server(request: pytest.FixtureRequest) -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(hello, http=request.param, log_level="error", lifespan="off")
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    yield port
    srv.should_exit = True
    t.join(timeout=5)


def test_slow_headers_are_dropped(server: int) -> None:
    # Arrange: a client that sends half its headers and then waits
    c = socket.create_connection(("127.0.0.1", server))
    c.settimeout(5)
    c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
    started = time.monotonic()

    # Act: the server closes the connection (recv returns b"") instead of waiting forever
    got = c.recv(100)

    # Assert
    assert got == b"" and time.monotonic() - started < 3
    c.close()


def test_a_prompt_request_on_a_kept_alive_connection_is_answered(server: int) -> None:
    c = socket.create_connection(("127.0.0.1", server))
    c.settimeout(5)

    answers = []
    for _ in range(2):
        c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answers.append(c.recv(1000))
        time.sleep(0.4)  # longer than the header deadline, between requests: keep-alive rules

    assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b"ok") for a in answers)
    c.close()
