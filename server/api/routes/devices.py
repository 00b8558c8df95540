"""Devices: enroll with the join token, revoke (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from fastapi.concurrency import run_in_threadpool
from seedfed.server import service
from seedfed.server.api.deps import AdminDep, RuntimeDep
from seedfed.server.api.openapi import DeviceIdPath, TaskIdPath, errors
from seedfed.server.schemas import Enrollment, EnrollRequest

router = APIRouter(prefix="/v1/tasks/{task_id}/devices", tags=["devices"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=Enrollment,
             responses=errors(400, 401, 403, 404, 413, 422))
async def enroll(task_id: TaskIdPath, body: EnrollRequest, rt: RuntimeDep) -> Enrollment:
    """Enroll a device with one of the task's join tokens. The device token is shown once.
    401: unknown or revoked join token; 403: the token enrolled all the devices it allows."""
    device_id, token = await run_in_threadpool(service.enroll_device, rt, task_id=task_id,
                                               join_token=body.join_token)
    return Enrollment(task_id=task_id, device_id=device_id, token=token)


@router.delete("/{device_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses=errors(401, 404, 422))
async def revoke(task_id: TaskIdPath, device_id: DeviceIdPath, rt: RuntimeDep,
                 _: AdminDep) -> Response:
    await run_in_threadpool(service.revoke_device, rt, task_id=task_id, device_id=device_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
