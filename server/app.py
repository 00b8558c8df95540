"""The FastAPI app factory of the coordinator.

`create_app(settings)` opens the runtime in the lifespan (engine, `alembic upgrade head`,
model store, recovery of rounds a crash left aggregating), starts the upload writer and the
ticker (closes rounds at quorum or deadline), answers every error with the status and body of
`seedfed.server.errors` (one table, below the app), limits request bodies, refuses repeated
headers, and mounts the dashboard (`seedfed.server.dashboard.router`) when that module exists.
It serves `/openapi.json` but not FastAPI's `/docs` and `/redoc` pages (they load a CDN).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from seedfed.server import errors as E
from seedfed.server import service
from seedfed.server.api.ingest import UploadFastPath
from seedfed.server.api.openapi import error_response, validation_issues
from seedfed.server.api.openapi import install as install_openapi
from seedfed.server.api.routes import devices, join_tokens, log, ops, rounds, tasks
from seedfed.server.runtime import Runtime, database_unavailable
from seedfed.server.settings import Settings
from seedfed.shared.protocol.errors import SeedfedError
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("seedfed.server")

async def _domain_error(_request: Request, exc: Exception) -> JSONResponse:
    code = E.status_of(exc)
    headers = E.error_headers(code) or None
    if code == 503:
        # An outage answers every request the same way: one line each, not a traceback.
        logger.warning("unavailable: %s: %s (cause: %s)", type(exc).__name__, exc,
                       (str(exc.__cause__).splitlines() or [""])[0] if exc.__cause__ else None)
    elif code >= 500:
        logger.error("internal error: %s", exc, exc_info=exc)
    return error_response(code, str(exc), type(exc).__name__, headers=headers)


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    # Routes that read through a request session (SessionDep) meet the driver's error outside
    # Runtime.transaction: the same typed 503.
    assert isinstance(exc, OperationalError | InterfaceError)
    err = database_unavailable(exc)
    err.__cause__ = exc
    return await _domain_error(request, err)


async def _request_invalid(_request: Request, exc: Exception) -> JSONResponse:
    # FastAPI's own 422 body ({"detail": [...]}) differs from every other error the service
    # answers; one ErrorBody keeps the OpenAPI document true. The input is not echoed back: it
    # can be large, and it is the caller's own.
    assert isinstance(exc, RequestValidationError)
    summary, issues = validation_issues(exc.errors())
    if any(i.get("type") == "json_invalid" for i in exc.errors()):
        # A body that is not JSON at all is malformed (400), as on the upload path; 422 is for
        # a body that parses but breaks a rule (server/README.md, "Errors").
        return error_response(400, summary, E.MalformedRequestError.__name__, issues=issues)
    return error_response(422, summary, "RequestValidationError", issues=issues)


async def _http_error(_request: Request, exc: Exception) -> Response:
    # Routing (404 unknown path, 405 method) and FastAPI's body parsing (400) raise these.
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code in (204, 304):  # no body allowed (as Starlette's own handler)
        return Response(status_code=exc.status_code, headers=exc.headers)
    return error_response(exc.status_code, str(exc.detail), "HTTPException",
                          headers=exc.headers)


class BodyLimit:
    """Refuse request bodies above `limit` bytes with a 413, declared (Content-Length) or
    streamed (chunked): the answer goes out as soon as the limit is passed, with `Connection:
    close` (the rest of the body is not read), and the app behind sees a disconnect, whatever
    it does with its body (a route's body parser would otherwise call the cut a bad body)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._reject(send, f"a request body of {int(value)} bytes")
                return
        seen = 0
        started = over = False

        async def limited() -> Message:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    over = True
                    if not started:
                        await self._reject(send, "a streamed request body of at least "
                                                 f"{seen} bytes")
                    return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg: Message) -> None:
            nonlocal started
            if over:
                return  # the 413 went out (or the body was cut under a started answer)
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        await self.app(scope, limited, guarded_send)

    async def _reject(self, send: Send, what: str) -> None:
        body = E.error_payload(f"{what} exceeds the limit of {self.limit} bytes (the "
                               "coordinator's max_body_bytes)", "PayloadTooLargeError")
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class HeaderGuard:
    """Refuse (400) a request that repeats a header whose value the coordinator reads as one:
    `X-Seedfed-*`, `Authorization`, `Content-Type`. A repeated header has no single meaning
    (the first or the last value? proxies differ), so one answer for every route beats each
    parser picking its own."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            seen: set[bytes] = set()
            for name, _ in scope.get("headers", []):
                if name.startswith(b"x-seedfed-") or name in _SINGLE_HEADERS:
                    if name in seen:
                        shown = name.decode("latin-1")[:64]
                        body = E.error_payload(f"header {shown} appears more than once; send "
                                               "it once", E.MalformedRequestError.__name__)
                        await send({"type": "http.response.start", "status": 400,
                                    "headers": [(b"content-type", b"application/json"),
                                                (b"content-length", str(len(body)).encode()),
                                                (b"connection", b"close")]})
                        await send({"type": "http.response.body", "body": body})
                        return
                    seen.add(name)
        await self.app(scope, receive, send)


_SINGLE_HEADERS = frozenset({b"authorization", b"content-type"})


async def _ticker(app: FastAPI, rt: Runtime) -> None:
    while True:
        await asyncio.sleep(rt.settings.tick_interval_s)
        try:
            await run_in_threadpool(service.tick, rt, auto_open=rt.settings.auto_open_rounds)
        except Exception:  # keep ticking; the next tick retries
            logger.exception("round ticker failed")


def mount_dashboard(app: FastAPI) -> bool:
    """Hook: include `seedfed.server.dashboard.router` (HTML at `/`) if the module exists."""
    try:
        module = importlib.import_module("seedfed.server.dashboard")
    except ModuleNotFoundError as e:
        if e.name not in ("seedfed.server.dashboard",):
            raise
        return False
    router = getattr(module, "router", None)
    if router is None:
        return False
    app.include_router(router)
    return True


def create_app(settings: Settings | None = None, *, runtime: Runtime | None = None) -> FastAPI:
    """The coordinator app. Pass `runtime` to share one with an in-process Coordinator."""
    settings = settings or (runtime.settings if runtime is not None else Settings())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime if runtime is not None else await run_in_threadpool(Runtime, settings)
        await run_in_threadpool(service.recover, rt)
        writer = service.UploadWriter(rt)
        writer.start()
        app.state.runtime, app.state.writer = rt, writer
        # The imports (torch, transformers) and the loaded model leave millions of long-lived
        # objects; a full collection scanning them stalls every request for 100-200 ms
        # (measured with `seedfed bench ingest`). Freezing moves them out of the collector's
        # sight: later collections scan only what requests allocate.
        gc.collect()
        gc.freeze()
        tick = asyncio.create_task(_ticker(app, rt))
        try:
            yield
        finally:
            gc.unfreeze()  # an embedding process (tests) gets its collector back
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
            writer.stop()
            if runtime is None:
                rt.close()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN, which a production
    # service should not hand its operators' browsers; /openapi.json stays (clients, fuzzers
    # and any local viewer read the contract from it).
    app = FastAPI(title="seedfed coordinator", version="1", docs_url=None, redoc_url=None,
                  description="Federated zeroth-order fine-tuning: tasks, devices, rounds, "
                              "scalar uploads, the seed-replay log and snapshots.",
                  lifespan=lifespan)
    for exc_type in (E.CoordinatorError, SeedfedError):
        app.add_exception_handler(exc_type, _domain_error)
    app.add_exception_handler(RequestValidationError, _request_invalid)
    for db_error in (OperationalError, InterfaceError):
        app.add_exception_handler(db_error, _database_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for module in (ops, tasks, devices, join_tokens, rounds, log):
        app.include_router(module.router)
    install_openapi(app)
    app.state.dashboard = mount_dashboard(app)
    if settings.upload_fast_path:
        app.add_middleware(UploadFastPath)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)  # sees every body
    app.add_middleware(HeaderGuard)  # outermost: a request with a repeated header goes no further
    return app


def app_from_env() -> Any:
    """`uvicorn --factory seedfed.server.app:app_from_env` (settings from env/TOML)."""
    return create_app(Settings())
