"""The update log and snapshots."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from seedfed.server import service
from seedfed.server.api.deps import ReaderDep, RuntimeDep, SessionDep
from seedfed.server.api.openapi import TaskIdPath, VersionPath, errors
from seedfed.shared.protocol.messages import (
    HEADER_CHECKSUM,
    HEADER_FORMAT,
    HEADER_SHA256,
    HEADER_VERSION,
)
from seedfed.shared.protocol.wire import MAX_VERSION, LogEntryWire

router = APIRouter(prefix="/v1/tasks/{task_id}", tags=["log"])

_SNAPSHOT_HEADERS = ((HEADER_CHECKSUM, "state checksum of the version (replay.checksum)"),
                     (HEADER_SHA256, "SHA-256 of the file"),
                     (HEADER_VERSION, "the version"),
                     (HEADER_FORMAT, "fp32 or the task's published format"))


@router.get("/log", response_model=list[LogEntryWire],
            responses=errors(401, 403, 404, 409, 422))
def log(task_id: TaskIdPath, session: SessionDep, rt: RuntimeDep, _: ReaderDep,
        since: Annotated[int, Query(ge=0, le=MAX_VERSION)] = 0,
        limit: Annotated[int | None, Query(ge=1, le=100_000)] = None) -> list[LogEntryWire]:
    """Entries after version `since`: seeds, float32 coefficients (base64) and checksum.
    409 `VersionAheadError` when `since` is beyond the task's current version."""
    return service.serve_log(rt, session, task_id=task_id, since=since, limit=limit)


@router.get("/snapshots/{version}", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {
                                 "schema": {"type": "string", "format": "binary"}}},
                             "description": "safetensors file",
                             "headers": {name: {"schema": {"type": "string"},
                                                "description": what}
                                         for name, what in _SNAPSHOT_HEADERS}},
                       **errors(401, 403, 404, 422, 500)})
def snapshot(task_id: TaskIdPath, version: VersionPath, session: SessionDep, rt: RuntimeDep,
             _: ReaderDep,
             format: Annotated[str | None, Query(
                 pattern=r"^[a-z0-9]{1,16}$",
                 description="fp32 (default) or the task's published format")] = None,
             ) -> StreamingResponse:
    """The trainable state of a version as safetensors (fp32 master by default), streamed.
    404 for a version whose files were pruned (`keep_versions`): take the current one or
    replay the log; 404 `FormatNotPublishedError` for a format the task does not publish."""
    (_path, sha, chk, size, fmt), stream = service.serve_snapshot(
        rt, session, task_id=task_id, version=version, fmt=format)
    return StreamingResponse(stream, media_type="application/octet-stream", headers={
        "Content-Length": str(size), HEADER_CHECKSUM: chk, HEADER_SHA256: sha,
        HEADER_VERSION: str(version), HEADER_FORMAT: fmt, "ETag": f'"{sha}"',
        "Content-Disposition": f'attachment; filename="{task_id}-v{version}.{fmt}.safetensors"'})
