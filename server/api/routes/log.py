"""The update log and snapshots."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from seedfed.shared.wire import LogEntryWire

from ... import service
from ..deps import ReaderDep, RuntimeDep, SessionDep

router = APIRouter(prefix="/v1/tasks/{task_id}", tags=["log"])


@router.get("/log", response_model=list[LogEntryWire])
def log(task_id: str, session: SessionDep, rt: RuntimeDep, _: ReaderDep,
        since: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int | None, Query(ge=1, le=100_000)] = None) -> list[LogEntryWire]:
    """Entries after version `since`: seeds, float32 coefficients (base64) and checksum."""
    entries = service.log_since(session, task_id=task_id, since=since, limit=limit)
    rt.metrics.bytes_out.labels("log").inc(sum(len(e.coefs) + 40 * len(e.seeds)
                                               for e in entries))
    return entries


@router.get("/snapshots/{version}", response_class=StreamingResponse,
            responses={200: {"content": {"application/octet-stream": {}},
                             "description": "safetensors file; headers X-Seedfed-Checksum "
                                            "(state checksum) and X-Seedfed-SHA256 (file)"}})
def snapshot(task_id: str, version: int, session: SessionDep, rt: RuntimeDep, _: ReaderDep,
             format: Annotated[str | None, Query(description="fp32 (default) or the task's "
                                                             "published format")] = None,
             ) -> StreamingResponse:
    """The trainable state of a version as safetensors (fp32 master by default), streamed.
    404 for a version whose files were pruned (`keep_versions`): take the current one or
    replay the log."""
    (_path, sha, chk, size, fmt), stream = service.open_snapshot(
        rt, session, task_id=task_id, version=version, fmt=format)
    rt.metrics.bytes_out.labels("snapshot").inc(size)
    return StreamingResponse(stream, media_type="application/octet-stream", headers={
        "Content-Length": str(size), "X-Seedfed-Checksum": chk, "X-Seedfed-SHA256": sha,
        "X-Seedfed-Version": str(version), "X-Seedfed-Format": fmt, "ETag": f'"{sha}"',
        "Content-Disposition": f'attachment; filename="{task_id}-v{version}.{fmt}.safetensors"'})
