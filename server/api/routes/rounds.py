"""Rounds: open, close and abandon (admin), the current plan, uploads and held-out metrics
(device)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, BackgroundTasks, Request, status
from fastapi.concurrency import run_in_threadpool
from seedfed.server import service
from seedfed.server.api.deps import (
    AdminDep,
    DeviceCredential,
    DeviceDep,
    ReaderDep,
    RuntimeDep,
    WriterDep,
)
from seedfed.server.api.ingest import close_after_answer, ingest
from seedfed.server.api.openapi import RoundPath, TaskIdPath, errors
from seedfed.server.errors import NotFoundError
from seedfed.server.schemas import AbandonedRound, AbandonRequest, MetricsReceipt, UploadReceipt
from seedfed.shared.protocol.messages import HEADER_LOSS, HEADER_NUM_EXAMPLES, HEADER_VERSION
from seedfed.shared.protocol.wire import (
    MAX_NUM_EXAMPLES,
    MAX_VERSION,
    DeviceMetrics,
    LogEntryWire,
    RoundPlan,
    Upload,
)

router = APIRouter(prefix="/v1/tasks/{task_id}/rounds", tags=["rounds"])

_UPLOAD_DOC: dict[str, Any] = {
    # Strings on the wire (headers); the same ranges as the JSON form's fields.
    "parameters": [{"name": name, "in": "header", "required": False,
                    "schema": {"type": "string", "maxLength": 32},
                    "description": "binary form only (required with it): " + what}
                   for name, what in (
                       (HEADER_VERSION, f"model version, integer 0..{MAX_VERSION}"),
                       (HEADER_NUM_EXAMPLES,
                        f"example count, integer 1..{MAX_NUM_EXAMPLES}"),
                       (HEADER_LOSS, "mean loss, a finite float"))],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": Upload.model_json_schema()},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary",
                           "description": "seedfed.shared.protocol.wire.pack_binary(matrix): "
                                          "b'SFS1', uint32 rows, uint32 cols, uint32 0, then "
                                          "rows*cols float32 LE. Version, example count and "
                                          "loss go in the X-Seedfed-Version, "
                                          "X-Seedfed-Num-Examples and X-Seedfed-Loss headers."}},
        },
    }
}


@router.post("", response_model=RoundPlan, status_code=status.HTTP_201_CREATED,
             responses=errors(401, 404, 409, 422))
async def open_round(task_id: TaskIdPath, rt: RuntimeDep, _: AdminDep) -> RoundPlan:
    """Open the next round (or return the round already open)."""
    return await run_in_threadpool(service.open_round, rt, task_id=task_id)


@router.get("/current", response_model=RoundPlan, responses=errors(401, 403, 404, 422))
async def current(task_id: TaskIdPath, rt: RuntimeDep, _: ReaderDep) -> RoundPlan:
    """The open round's plan: version, seeds (steps x perturbations), lr, eps, deadline."""
    known, plan = service.cached_plan(rt, task_id=task_id)
    if not known:
        plan = await run_in_threadpool(service.current_plan, rt, task_id=task_id)
    if plan is None:
        raise NotFoundError(f"task {task_id!r} has no open round")
    return plan


@router.post("/{round_number}/close", response_model=LogEntryWire,
             responses=errors(401, 404, 409, 422, 500))
async def close(task_id: TaskIdPath, round_number: RoundPath, rt: RuntimeDep,
                _: AdminDep) -> LogEntryWire:
    """Aggregate what arrived and commit the new version (the round's log entry)."""
    return await run_in_threadpool(service.close_round, rt, task_id=task_id,
                                   number=round_number)


@router.post("/{round_number}/abandon", response_model=AbandonedRound,
             responses=errors(400, 401, 404, 409, 422))
async def abandon(task_id: TaskIdPath, round_number: RoundPath, body: AbandonRequest,
                  rt: RuntimeDep, _: AdminDep) -> AbandonedRound:
    """End an open or aggregating round without a new version (e.g. one whose close fails on
    every attempt): its uploads are not aggregated, the reason is kept and shown, and the
    task goes on from its committed version. 409 when the round already ended."""
    return await run_in_threadpool(service.abandon_round, rt, task_id=task_id,
                                   number=round_number, reason=body.reason)


@router.post("/{round_number}/uploads", response_model=UploadReceipt,
             responses=errors(400, 401, 403, 404, 409, 413, 422), openapi_extra=_UPLOAD_DOC)
async def upload(
    task_id: TaskIdPath, round_number: RoundPath, request: Request, device: DeviceCredential,
    rt: RuntimeDep, writer: WriterDep, background: BackgroundTasks,
) -> UploadReceipt:
    """Upload a device's scalars for the round: JSON `Upload`, or the binary form.

    A byte-identical retry returns the original receipt (200); a different second upload
    from the device in the same round is a 409.
    """
    receipt, due = await ingest(rt, writer, task_id=task_id, round_number=round_number,
                                device=device, headers=request.headers,
                                body=await request.body())
    if due is not None:
        background.add_task(close_after_answer, rt, task_id=task_id, round_id=due)
    return receipt


@router.post("/{round_number}/metrics", response_model=MetricsReceipt,
             responses=errors(400, 401, 403, 404, 413, 422))
async def metrics(task_id: TaskIdPath, round_number: RoundPath, body: DeviceMetrics,
                  device: DeviceDep, rt: RuntimeDep) -> MetricsReceipt:
    """A device's held-out accuracies after its part in the round (numbers only): shared model
    alone, shared + personal, local only. A repeat replaces the device's earlier report for
    the round."""
    return await run_in_threadpool(service.record_device_metrics, rt, task_id=task_id,
                                   round_number=round_number, device_id=device, metrics=body)
