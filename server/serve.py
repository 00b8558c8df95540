"""Run the coordinator under uvicorn (what `seedfed coordinator` calls)."""

from __future__ import annotations

import sys

from .settings import Settings


def serve(settings: Settings, *, log_level: str = "info") -> None:
    import uvicorn

    from .app import create_app
    from .connections import http_protocol

    if settings.token_was_generated:
        print(f"admin token (generated): {settings.token}", file=sys.stderr)  # shown once
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=log_level, access_log=False,
                timeout_keep_alive=int(settings.keep_alive_s),
                http=http_protocol(settings.header_timeout_s),  # drops slow-header clients
                ssl_certfile=str(settings.tls_certfile) if settings.tls_certfile else None,
                ssl_keyfile=str(settings.tls_keyfile) if settings.tls_keyfile else None)
