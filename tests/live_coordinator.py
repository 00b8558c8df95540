"""A real coordinator over real HTTP for tests of the command lines that talk to one: the app
under uvicorn on a free loopback port, in a background thread (no port race: the socket is
bound here and handed to uvicorn)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from seedfed.server.settings import Settings

ADMIN_TOKEN = "admin-" + "y" * 24


def live_settings(tmp: Path, **over: object) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp / 'c.db'}", store_dir=tmp / "store",
                    admin_token=ADMIN_TOKEN, **over)  # type: ignore[arg-type]


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run `app` under uvicorn; yield its base URL; stop it afterwards."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
