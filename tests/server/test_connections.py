"""The connection guards of `seedfed.server.connections`: slow headers and stalled bodies are
dropped, and anonymous connections are capped (oldest evicted), under both HTTP protocols."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from seedfed.server.connections import (
    AnonymousConnections,
    H11Guarded,
    http_protocol,
    trust,
)


async def hello(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body; `/trust` marks the connection authenticated first."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/trust":
        trust(scope)
    body = b""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    answer = b"ok %d" % len(body)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


CAP = 5


def _protocols() -> list[type[asyncio.Protocol]]:
    h11 = type("H11Fast", (H11Guarded,), {"header_timeout_s": 0.3, "body_timeout_s": 0.5,
                                          "anonymous": AnonymousConnections(CAP)})
    return [h11, http_protocol(0.3, 0.5, CAP)]


def _serve(app: Any, protocol: type[asyncio.Protocol]) -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, http=protocol, log_level="error", lifespan="off")
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    yield port
    srv.should_exit = True
    t.join(timeout=5)


@pytest.fixture(params=_protocols(), ids=lambda c: c.__mro__[1].__name__)
def server(request: pytest.FixtureRequest) -> Iterator[int]:
    # A fresh class per test: the anonymous cap is per class (one server each).
    cls = type(request.param.__name__, (request.param,),
               {"anonymous": AnonymousConnections(CAP)})
    yield from _serve(hello, cls)


def _request(port: int, head: bytes, body: bytes = b"") -> socket.socket:
    c = socket.create_connection(("127.0.0.1", port))
    c.settimeout(5)
    c.sendall(head + body)
    return c


def _post(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\n"
            .encode())


def _answer(c: socket.socket) -> bytes:
    """One whole answer (its headers and content-length bytes of body)."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += c.recv(4096)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += c.recv(4096)
    return head + b"\r\n\r\n" + body


def _read_all(c: socket.socket) -> bytes:
    out = b""
    while chunk := c.recv(4096):
        out += chunk
    return out


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
        answers.append(_answer(c))
        time.sleep(0.4)  # longer than the header deadline, between requests: keep-alive rules

    assert all(a.startswith(b"HTTP/1.1 200") and a.endswith(b"ok 0") for a in answers)
    c.close()


def test_a_stalled_body_is_answered_408_and_closed(server: int) -> None:
    # Arrange: headers and 1 byte of a declared 100, then nothing
    c = _request(server, _post("/", 100), b"x")
    started = time.monotonic()

    # Act
    answer = _read_all(c)

    # Assert: 408 with the error body, then the close; after the body deadline, not at once
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:60]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"] == "RequestTimeoutError" and "body_timeout_s" in body["detail"]
    assert 0.4 < time.monotonic() - started < 3
    c.close()


def test_a_body_that_keeps_moving_is_not_cut(server: int) -> None:
    # Arrange: 8 bytes, one every 0.2 s: 1.6 s in all, each pause under the 0.5 s deadline
    c = _request(server, _post("/", 8))

    # Act
    for _ in range(8):
        time.sleep(0.2)
        c.sendall(b"y")
    answer = _answer(c)

    # Assert
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok 8")
    c.close()


def test_time_the_app_does_not_read_is_not_the_clients_delay() -> None:
    # Arrange: an app that waits 1.2 s (past the 0.5 s deadline) before reading the body
    async def slow_reader(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(1.2)
        await hello(scope, receive, send)

    big = 200_000  # above uvicorn's 64 kB buffer: reading pauses until the app reads
    for protocol in _protocols():
        cls = type("P", (protocol,), {"anonymous": None})
        for port in _serve(slow_reader, cls):
            c = _request(port, _post("/", big))

            # Act: the client sends everything at once; the server stops reading
            c.sendall(b"z" * big)
            answer = _answer(c)

            # Assert
            assert answer.startswith(b"HTTP/1.1 200"), (protocol, answer[:60])
            assert answer.endswith(b"ok %d" % big)
            c.close()


def test_the_oldest_anonymous_connection_makes_room_for_a_new_one(server: int) -> None:
    # Arrange: CAP anonymous connections (a request's first bytes each)
    first = [_request(server, b"POST / HTTP/1.1\r\n") for _ in range(CAP)]
    time.sleep(0.05)

    # Act: one more
    newcomer = _request(server, b"POST / HTTP/1.1\r\n")
    time.sleep(0.1)

    # Assert: the oldest was closed at once (before any deadline), the others are open
    assert first[0].recv(100) == b""
    newcomer.sendall(b"Host: x\r\nContent-Length: 0\r\n\r\n")
    assert _answer(newcomer).startswith(b"HTTP/1.1 200")
    for c in first[1:]:
        c.sendall(b"Host: x\r\nContent-Length: 0\r\n\r\n")
        assert _answer(c).startswith(b"HTTP/1.1 200")
    for c in (*first, newcomer):
        c.close()


def test_trusted_connections_do_not_count_against_the_cap(server: int) -> None:
    # Arrange: CAP connections that authenticated (the app called trust) and stay open
    kept = []
    for _ in range(CAP):
        c = _request(server, _post("/trust", 0))
        assert _answer(c).startswith(b"HTTP/1.1 200")
        kept.append(c)

    # Act: CAP new anonymous connections
    anonymous = [_request(server, b"GET / HTTP/1.1\r\n") for _ in range(CAP)]
    time.sleep(0.1)

    # Assert: nothing was evicted; the trusted ones still answer
    for c in anonymous:
        c.sendall(b"Host: x\r\n\r\n")
        assert _answer(c).startswith(b"HTTP/1.1 200")
    for c in kept:
        c.sendall(_post("/", 0))
        assert _answer(c).startswith(b"HTTP/1.1 200")
    for c in (*kept, *anonymous):
        c.close()


def test_a_request_answered_before_its_body_ended_is_closed_after_the_answer() -> None:
    # Arrange: an app that answers without reading the body (a route without one, a refusal)
    async def early(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})

    for protocol in _protocols():
        cls = type("P", (protocol,), {"anonymous": None})
        for port in _serve(early, cls):
            c = _request(port, _post("/", 10_000_000), b"x")
            started = time.monotonic()

            # Act: the client would trickle the rest of its 10 MB
            answer = _read_all(c)

            # Assert: the answer, then the close at once (not after the body deadline)
            assert answer.startswith(b"HTTP/1.1 401") and answer.endswith(b"no"), answer
            assert time.monotonic() - started < 0.4
            c.close()

