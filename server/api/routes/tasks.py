"""Tasks: create (admin), list, status, stats, catch-up plan."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, status
from fastapi.concurrency import run_in_threadpool
from seedfed.server import service
from seedfed.server.api.deps import (
    AdminDep,
    ReaderDep,
    RuntimeDep,
    SessionDep,
    SpecReaderDep,
    StatsReaderDep,
)
from seedfed.server.api.openapi import TaskIdPath, errors
from seedfed.server.schemas import (
    CatchupPlan,
    RoundMetrics,
    ScheduleUpdate,
    TaskCreate,
    TaskCreated,
    TaskStats,
    TaskStatus,
)
from seedfed.shared.protocol.wire import MAX_VERSION

router = APIRouter(prefix="/v1/tasks", tags=["tasks"])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TaskCreated,
             responses=errors(400, 401, 413, 422))
async def create_task(body: TaskCreate, rt: RuntimeDep, _: AdminDep) -> TaskCreated:
    """Create a task from a local Hugging Face model directory; builds and stores version 0.
    The join token in the answer is shown once. With `schedule: auto` (the default) the
    coordinator runs its rounds back to back once a device enrolled, until `max_rounds`."""
    task_id, join, version, chk = await run_in_threadpool(
        service.create_task, rt, spec=body.spec, name=body.name, quorum=body.quorum,
        round_timeout_s=body.round_timeout_s, devices_per_round=body.devices_per_round,
        max_devices_per_token=body.max_devices_per_token, schedule=body.schedule,
        max_rounds=body.max_rounds)
    return TaskCreated(task_id=task_id, join_token=join, version=version, checksum=chk)


@router.patch("/{task_id}/schedule", response_model=TaskStatus,
              responses=errors(400, 401, 404, 422))
def schedule(task_id: TaskIdPath, body: ScheduleUpdate, session: SessionDep, rt: RuntimeDep,
             _: AdminDep) -> TaskStatus:
    """Who opens the task's rounds from now on (`auto`: the coordinator, back to back;
    `manual`: only `POST .../rounds`) and the automatic schedule's limit (`max_rounds`; null
    removes it). Answers the task's status."""
    service.set_schedule(rt, task_id=task_id, schedule=body.schedule,
                         max_rounds=body.max_rounds,
                         clear_limit="max_rounds" in body.model_fields_set
                         and body.max_rounds is None)
    return service.task_status(rt, session, task_id=task_id)


@router.get("", response_model=list[TaskStatus], responses=errors(401))
def list_tasks(session: SessionDep, rt: RuntimeDep, _: StatsReaderDep) -> list[TaskStatus]:
    return [service.task_status(rt, session, task_id=t.id) for t in service.list_tasks(session)]


@router.get("/{task_id}", response_model=TaskStatus, responses=errors(401, 403, 404, 422))
def get_task(task_id: TaskIdPath, session: SessionDep, rt: RuntimeDep, _: ReaderDep) -> TaskStatus:
    return service.task_status(rt, session, task_id=task_id)


@router.get("/{task_id}/spec", responses=errors(401, 403, 404, 422))
def task_spec(task_id: TaskIdPath, session: SessionDep, _: SpecReaderDep) -> dict[str, Any]:
    """The task definition (TaskSpec as JSON) a device builds its model and scope from; the
    device substitutes its own copy of the base model for `model_path`. Readable with the
    admin token, a device token of the task, or one of its join tokens (a device checks its
    data and model against the task before it enrolls)."""
    return service.task_spec(session, task_id=task_id).to_dict()


@router.get("/{task_id}/stats", response_model=TaskStats, responses=errors(401, 404, 422))
def task_stats(task_id: TaskIdPath, session: SessionDep, rt: RuntimeDep,
               _: StatsReaderDep) -> TaskStats:
    """Per-round participation, loss and bytes (the dashboard's data)."""
    return service.task_stats(session, task_id=task_id, delta=rt.settings.dp_delta)


@router.get("/{task_id}/rounds", response_model=list[RoundMetrics],
            responses=errors(401, 404, 422))
def rounds(task_id: TaskIdPath, session: SessionDep, _: StatsReaderDep) -> list[RoundMetrics]:
    return service.round_metrics(session, task_id=task_id)


@router.get("/{task_id}/catchup", response_model=CatchupPlan,
            responses=errors(401, 403, 404, 409, 422))
def catchup(task_id: TaskIdPath, session: SessionDep, _: ReaderDep,
            from_version: Annotated[int, Query(alias="from", ge=0, le=MAX_VERSION)],
            # Bounded so that every estimate (bytes / rate) is a finite JSON number.
            bandwidth: Annotated[float, Query(ge=1, le=1e15, description="device bytes/s")
                                 ] = 2e6,
            regen_rate: Annotated[float, Query(ge=1, le=1e15, description="elements/s")
                                  ] = 1e8,
            ) -> CatchupPlan:
    """Replay the log or download the latest snapshot, whichever the device's bandwidth and
    regeneration rate make cheaper. 409 `VersionAheadError` when `from` is beyond the task's
    current version."""
    return service.catchup_plan(session, task_id=task_id, from_version=from_version,
                                bandwidth=bandwidth, regen_rate=regen_rate)
