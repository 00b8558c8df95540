"""The FastAPI app factory of the coordinator.

`create_app(settings)` opens the runtime in the lifespan (engine, `alembic upgrade head`,
model store, recovery of rounds a crash left aggregating), starts the upload writer and the
ticker (closes rounds at quorum or deadline), maps the typed domain errors to HTTP statuses in
one place, limits request bodies, and mounts the dashboard (`seedfed.server.dashboard.router`)
when that module exists.
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
from fastapi.responses import JSONResponse
from seedfed.shared.errors import NonFiniteScalarError, SeedfedError, ShapeError, WireFormatError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import errors as E
from . import service
from .api.ingest import UploadFastPath
from .api.routes import devices, log, ops, rounds, tasks
from .runtime import Runtime
from .settings import Settings

logger = logging.getLogger("seedfed.server")

#: The one mapping from domain errors to HTTP statuses (first match in MRO order wins).
_STATUS: dict[type[BaseException], int] = {
    E.MalformedRequestError: 400,
    E.AuthenticationError: 401,
    E.PermissionDeniedError: 403,
    E.NotFoundError: 404,
    E.ConflictError: 409,
    E.PayloadTooLargeError: 413,
    E.InvalidUploadError: 422,
    E.InvalidTaskError: 422,
    WireFormatError: 422,
    ShapeError: 422,
    NonFiniteScalarError: 422,
    E.StoreError: 500,
    SeedfedError: 400,
}


def status_of(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return 500


async def _domain_error(_request: Request, exc: Exception) -> JSONResponse:
    code = status_of(exc)
    headers = {"WWW-Authenticate": "Bearer"} if code == 401 else None
    if code >= 500:
        logger.error("internal error: %s", exc, exc_info=exc)
    return JSONResponse({"detail": str(exc), "error": type(exc).__name__}, status_code=code,
                        headers=headers)


class BodyLimit:
    """Refuse request bodies above `limit` bytes with a 413 (declared or streamed)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._reject(send, int(value))
                return
        seen = 0
        started = False

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise E.PayloadTooLargeError(f"request body exceeds {self.limit} bytes")
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited, tracking_send)
        except E.PayloadTooLargeError:
            if started:
                raise
            await self._reject(send, seen)

    async def _reject(self, send: Send, size: int) -> None:
        body = JSONResponse({"detail": f"request body of {size} bytes exceeds the limit of "
                                       f"{self.limit} bytes", "error": "PayloadTooLargeError"},
                            status_code=413).body
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


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
        # (measured with benchmarks/ingest.py). Freezing moves them out of the collector's
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

    app = FastAPI(title="seedfed coordinator", version="1",
                  description="Federated zeroth-order fine-tuning: tasks, devices, rounds, "
                              "scalar uploads, the seed-replay log and snapshots.",
                  lifespan=lifespan)
    for exc_type in (E.CoordinatorError, SeedfedError):
        app.add_exception_handler(exc_type, _domain_error)
    for module in (ops, tasks, devices, rounds, log):
        app.include_router(module.router)
    app.state.dashboard = mount_dashboard(app)
    if settings.upload_fast_path:
        app.add_middleware(UploadFastPath)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)  # outermost: sees every body
    return app


def app_from_env() -> Any:
    """`uvicorn --factory seedfed.server.app:app_from_env` (settings from env/TOML)."""
    return create_app(Settings())
