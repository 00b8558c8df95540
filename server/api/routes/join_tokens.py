"""Join tokens (admin): rotate, list, revoke. Each token enrolls a limited number of devices."""

from __future__ import annotations

from fastapi import APIRouter, Response, status
from fastapi.concurrency import run_in_threadpool
from seedfed.server.api.deps import AdminDep, RuntimeDep, SessionDep
from seedfed.server.api.openapi import DeviceIdPath, TaskIdPath, errors
from seedfed.server.schemas import JoinTokenCreate, JoinTokenCreated, JoinTokenInfo
from seedfed.server.service import join_tokens

router = APIRouter(prefix="/v1/tasks/{task_id}/join-tokens", tags=["devices"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JoinTokenCreated,
             responses=errors(400, 401, 404, 413, 422))
async def create(task_id: TaskIdPath, body: JoinTokenCreate, rt: RuntimeDep,
                 _: AdminDep) -> JoinTokenCreated:
    """A new join token, shown once; with `revoke_others` (default) this is a rotation."""
    token_id, token, revoked = await run_in_threadpool(
        join_tokens.create_join_token, rt, task_id=task_id, max_devices=body.max_devices,
        revoke_others=body.revoke_others)
    return JoinTokenCreated(token_id=token_id, join_token=token,
                            max_devices=join_tokens.effective_limit(rt, body.max_devices),
                            revoked=revoked)


@router.get("", response_model=list[JoinTokenInfo], responses=errors(401, 404, 422))
def listing(task_id: TaskIdPath, session: SessionDep, rt: RuntimeDep,
            _: AdminDep) -> list[JoinTokenInfo]:
    return [JoinTokenInfo(token_id=r.id, max_devices=join_tokens.limit_of(rt, r),
                          enrolled=r.enrolled, created_at=r.created_at, revoked_at=r.revoked_at)
            for r in join_tokens.list_join_tokens(session, task_id=task_id)]


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses=errors(401, 404, 422))
async def revoke(task_id: TaskIdPath, token_id: DeviceIdPath, rt: RuntimeDep,
                 _: AdminDep) -> Response:
    """Revoke a join token: it enrolls no more devices (those it enrolled stay)."""
    await run_in_threadpool(join_tokens.revoke_join_token, rt, task_id=task_id,
                            token_id=token_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
