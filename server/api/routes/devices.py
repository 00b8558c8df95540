"""Devices: enroll with the join token, revoke (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from fastapi.concurrency import run_in_threadpool

from ... import service
from ...schemas import Enrollment, EnrollRequest
from ..deps import AdminDep, RuntimeDep

router = APIRouter(prefix="/v1/tasks/{task_id}/devices", tags=["devices"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=Enrollment)
async def enroll(task_id: str, body: EnrollRequest, rt: RuntimeDep) -> Enrollment:
    """Enroll a device with the task's join token. The device token is shown once."""
    device_id, token = await run_in_threadpool(service.enroll_device, rt, task_id=task_id,
                                               join_token=body.join_token)
    return Enrollment(task_id=task_id, device_id=device_id, token=token)


@router.delete("/{device_id}", status_code=status.HTTP_204_NO_CONTENT)
async def revoke(task_id: str, device_id: str, rt: RuntimeDep, _: AdminDep) -> Response:
    await run_in_threadpool(service.revoke_device, rt, task_id=task_id, device_id=device_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
