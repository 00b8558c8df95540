"""Dependencies of the routes: runtime, session, admin and device authentication."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from seedfed.server import service
from seedfed.server.api.openapi import TaskIdPath
from seedfed.server.connections import trust
from seedfed.server.errors import AuthenticationError
from seedfed.server.runtime import Runtime
from seedfed.server.service import join_tokens
from seedfed.server.service.uploads import UploadWriter
from sqlalchemy.orm import Session

_bearer = HTTPBearer(auto_error=False, description="Admin token or device token")


# Async (not def) so FastAPI resolves them inline instead of hopping to its thread pool: they
# sit on the upload hot path.
async def get_runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


async def get_writer(request: Request) -> UploadWriter:
    writer: UploadWriter = request.app.state.writer
    return writer


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
WriterDep = Annotated[UploadWriter, Depends(get_writer)]


def get_session(rt: RuntimeDep) -> Iterator[Session]:
    """A session for one request; service functions commit their own unit of work."""
    with rt.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _is_admin(rt: Runtime, creds: HTTPAuthorizationCredentials | None) -> bool:
    return creds is not None and hmac.compare_digest(creds.credentials.encode(),
                                                     rt.settings.token.encode())


async def require_admin(request: Request, rt: RuntimeDep, creds: Credentials) -> None:
    if creds is None:
        raise AuthenticationError("missing Authorization: Bearer <admin token>")
    if not _is_admin(rt, creds):
        raise AuthenticationError("wrong admin token")
    trust(request.scope)  # the connection no longer counts as anonymous


AdminDep = Annotated[None, Depends(require_admin)]


async def current_device(request: Request, task_id: TaskIdPath, rt: RuntimeDep,
                         creds: Credentials) -> str:
    """The device id of the bearer token, which must belong to the task in the path."""
    if creds is None:
        raise AuthenticationError("missing Authorization: Bearer <device token>")
    device_id, token_hash = await device_credential(task_id, rt, creds)
    if device_id is None:  # not cached: one query (the cached one is the hot path)
        device_id = await run_in_threadpool(service.authenticate_hash, rt, task_id=task_id,
                                            token_hash=token_hash)
    trust(request.scope)  # the connection no longer counts as anonymous
    return device_id


#: The device of the bearer token (a device of the task in the path; admin not accepted).
DeviceDep = Annotated[str, Depends(current_device)]


async def device_credential(task_id: TaskIdPath, rt: RuntimeDep,
                            creds: Credentials) -> tuple[str | None, str]:
    """(device id if the token is cached, token hash) for the upload path: an uncached token
    is authenticated by the upload writer together with the rest of its batch."""
    # One rule for both doors: the FastAPI route and the ASGI fast path.
    return service.bearer_device(rt, task_id=task_id, authorization=None if creds is None
                                 else f"Bearer {creds.credentials}")


DeviceCredential = Annotated[tuple[str | None, str], Depends(device_credential)]


async def reader(request: Request, task_id: TaskIdPath, rt: RuntimeDep,
                 creds: Credentials) -> str | None:
    """Admin (returns None) or a device of the task (returns its id)."""
    if _is_admin(rt, creds):
        trust(request.scope)
        return None
    return await current_device(request, task_id, rt, creds)


ReaderDep = Annotated[str | None, Depends(reader)]


async def spec_reader(request: Request, task_id: TaskIdPath, rt: RuntimeDep,
                      creds: Credentials) -> str | None:
    """`reader`, or the holder of one of the task's join tokens (returns None): a device reads
    the task definition, and so learns that its join token is good, before it enrolls."""
    try:
        return await reader(request, task_id, rt, creds)
    except AuthenticationError:
        if creds is None or not await run_in_threadpool(
                join_tokens.accepts, rt, task_id=task_id, join_token=creds.credentials):
            raise
    return None


SpecReaderDep = Annotated[str | None, Depends(spec_reader)]


async def stats_reader(request: Request, rt: RuntimeDep, creds: Credentials) -> None:
    if not rt.settings.public_stats:
        await require_admin(request, rt, creds)


StatsReaderDep = Annotated[None, Depends(stats_reader)]
