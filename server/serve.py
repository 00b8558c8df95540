"""Run the coordinator under uvicorn (what `seedfed coordinator` calls).

What can stop a start is checked before uvicorn runs, each as one StartupError naming the
option to fix: the address (`--host`/`--port`: the socket is bound here and handed to uvicorn,
so a port in use is found at once, and no other process can take it in between), then the
database (`--db`: opened and migrated) and the model store (`--store`).
"""

from __future__ import annotations

import errno
import socket
import sys

from seedfed.server.runtime import Runtime
from seedfed.server.settings import Settings
from seedfed.shared.protocol.errors import UserError
from seedfed.shared.protocol.redact import redact, redact_url

DB_HINT = ("give --db (or SEEDFED_DATABASE_URL) a reachable database: e.g. "
           "sqlite:///seedfed.db or postgresql+psycopg://user@host:5432/db")


class StartupError(UserError):
    """The coordinator cannot start as configured (address, database, model store)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port), as uvicorn binds one."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port} ({e.strerror or e})",
                           "check --host: an address of this machine, e.g. 127.0.0.1 "
                           "or 0.0.0.0") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is in use (--port)",
                               "stop the process that holds it, or choose another --port"
                               ) from e
        raise StartupError(f"cannot listen on {host}:{port} ({e.strerror or e})",
                           "check --host and --port (ports below 1024 need privileges)") from e
    sock.set_inheritable(True)
    return sock


def open_runtime(settings: Settings) -> Runtime:
    """The coordinator's runtime (database opened and migrated, model store ready)."""
    try:
        return Runtime(settings)
    except OSError as e:
        where = e.filename or settings.store_dir
        raise StartupError(f"cannot use {where} ({e.strerror or e})",
                           "check --store (the model store directory) and --db") from e
    except Exception as e:  # noqa: BLE001 (driver, URL and connection errors of any backend)
        lines = str(e).strip().splitlines()
        why = redact(lines[0] if lines else type(e).__name__)
        raise StartupError(f"cannot open the database {redact_url(settings.database_url)} "
                           f"(--db): {why}", DB_HINT) from e


def serve(settings: Settings, *, log_level: str = "info") -> None:
    import uvicorn
    from seedfed.server.app import create_app
    from seedfed.server.connections import http_protocol

    for option, path in (("--tls-cert", settings.tls_certfile),
                         ("--tls-key", settings.tls_keyfile)):
        if path is not None and not path.is_file():
            raise StartupError(f"no file at {path} ({option})", "give the PEM file's path")
    sock = bind(settings.host, settings.port)
    try:
        runtime = open_runtime(settings)
    except BaseException:
        sock.close()
        raise
    if settings.token_was_generated:
        print(f"admin token (generated): {settings.token}", file=sys.stderr)  # shown once
    config = uvicorn.Config(
        create_app(settings, runtime=runtime), log_level=log_level, access_log=False,
        timeout_keep_alive=int(settings.keep_alive_s),
        # drops slow headers and stalled bodies, caps anonymous connections
        http=http_protocol(settings.header_timeout_s, settings.body_timeout_s,
                           settings.max_anonymous_connections),
        ssl_certfile=str(settings.tls_certfile) if settings.tls_certfile else None,
        ssl_keyfile=str(settings.tls_keyfile) if settings.tls_keyfile else None)
    server = uvicorn.Server(config)
    scheme = "https" if settings.tls_certfile else "http"
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # IPv6
    # uvicorn names the address only when it binds the socket itself
    print(f"coordinator listening on {scheme}://{host}:{port} (Ctrl+C stops it)",
          file=sys.stderr)
    try:
        server.run(sockets=[sock])
    finally:
        runtime.close()
        sock.close()
    if not server.started:
        raise StartupError("the coordinator stopped while starting (its log above says why)",
                           "fix what the log names and start it again")
