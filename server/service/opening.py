"""Opening rounds: by hand (`POST .../rounds`, the facade, the Flower ServerApp) or by the
task's automatic schedule, and who opens a task's rounds (`set_schedule`).

A task's `schedule` is `auto` or `manual` (`orm.Schedule`). The schedule (`open_idle`, run by
the app's ticker, and `open_scheduled` right after a close at quorum) opens the next round of
an `auto` task as soon as the last one ended (closed, expired or abandoned), once the task has
an enrolled device and until its version reaches `max_rounds`. Opening a round by hand takes
the task over: an `auto` task becomes `manual` in the same unit of work, so a driver that opens
every round itself (the Flower ServerApp's strategy, an operator) never has the schedule open
rounds beside it; `set_schedule` hands the task back.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from seedfed.server.aggregation import draw_seeds
from seedfed.server.errors import ConflictError, InvalidTaskError, NotFoundError
from seedfed.server.orm import DeviceRow, RoundRow, RoundState, Schedule, TaskRow, UploadRow, utcnow
from seedfed.server.runtime import Runtime
from seedfed.server.service.tasks import mask_epoch_of, round_cap_of, spec_of
from seedfed.shared.model.quant.scales_scope import plan_clip
from seedfed.shared.protocol.wire import RoundPlan
from sqlalchemy import func, select
from sqlalchemy.orm import Session

logger = logging.getLogger("seedfed.server")


def latest_round(session: Session, task_id: str) -> RoundRow | None:
    return session.scalars(select(RoundRow).where(RoundRow.task_id == task_id)
                           .order_by(RoundRow.number.desc()).limit(1)).first()


def locked_task(s: Session, task_id: str) -> TaskRow:
    """The task row as committed now (never the session's cached copy), locked against a
    concurrent version move on PostgreSQL (FOR NO KEY UPDATE: a close's commit waits for this
    unit of work; enrolment's foreign-key locks do not)."""
    task = s.scalars(select(TaskRow).where(TaskRow.id == task_id)
                     .with_for_update(key_share=True)
                     .execution_options(populate_existing=True)).first()
    if task is None:
        raise NotFoundError(f"task {task_id!r} does not exist")
    return task


def abandon_stale(s: Session, row: RoundRow, current: int) -> None:
    """Close a round planned at a base version the task has moved past (`current`): it can
    never commit (its uploads were computed at that base), so it ends without a new version
    and its uploads are refused from now on (the round is no longer open)."""
    n = s.scalar(select(func.count()).select_from(UploadRow)
                 .where(UploadRow.round_id == row.id)) or 0
    logger.error("round %s of task %s was planned at v%s but the task is at v%s: abandoned "
                 "without a new version (%d upload(s) not aggregated)", row.number, row.task_id,
                 row.base_version, current, n)
    row.state, row.closed_at, row.participants = RoundState.ABANDONED, utcnow(), 0
    row.abandon_reason = (f"planned at v{row.base_version}, but the task moved to v{current}: "
                          "it could never commit")


def limit_reached(task: TaskRow) -> bool:
    """Whether the automatic schedule has run the task to its `max_rounds` version."""
    return task.max_rounds is not None and task.current_version >= task.max_rounds


def _plan(task: TaskRow, number: int, now: datetime) -> RoundPlan:
    spec = spec_of(task)
    h = spec.hyper
    r = spec.round_hyper(number, task.current_version)  # a head epoch's own lr, shape
    return RoundPlan(task_id=task.id, round=number, version=task.current_version,
                     seeds=draw_seeds(task.secret, number, r.steps, r.perturbations),
                     lr=r.lr, eps=h.eps, batch_size=h.batch_size,
                     clip=plan_clip(spec.scope, h.clip),  # QZO's DDC: C=100 for scales
                     one_sided=h.one_sided, scope=spec.scope,
                     deadline=now + timedelta(seconds=task.round_timeout_s),
                     quorum=task.quorum,
                     mask_epoch=mask_epoch_of(spec, task.current_version))


def _take_over(task: TaskRow) -> None:
    """A round opened by hand: the task's rounds are opened by hand from now on."""
    if task.schedule == Schedule.AUTO:
        task.schedule = Schedule.MANUAL
        logger.info("task %s: a round was opened by hand (POST rounds); its rounds are opened "
                    "by hand from now on (schedule manual)", task.id)


def _open(rt: Runtime, task_id: str, *, scheduled: bool) -> RoundPlan | None:
    """Open the task's next round at its committed version, or return the open one; with
    `scheduled`, only what the automatic schedule may open (None otherwise).

    The latest round is read before the task row. A close moves the task's version and closes
    its round in one commit, and each statement sees every commit before it (PostgreSQL's
    READ COMMITTED; SQLite, where pysqlite begins no transaction before the first write), so a
    round seen closed here has its version visible to the task read after it. (Reading the
    task first let a close commit in between: round n + 1 opened at v(n - 1), which could
    never commit and stayed `aggregating` for good.) The base is checked again after the
    insert, inside the same unit of work; an open round planned at a stale base (from an
    older coordinator) is abandoned and the next one planned at the committed version."""
    abandoned: int | None = None
    with rt.state_lock, rt.transaction() as s:
        last = latest_round(s, task_id)
        task = locked_task(s, task_id)
        if scheduled and (task.schedule != Schedule.AUTO or limit_reached(task)):
            return None  # handed to an operator, or done, since the ticker looked
        if not scheduled:
            _take_over(task)
        if last is not None and last.state == RoundState.OPEN:
            if last.base_version == task.current_version:
                return RoundPlan.model_validate_json(last.plan_json)
            abandon_stale(s, last, task.current_version)
            abandoned = last.id
        if last is not None and last.state == RoundState.AGGREGATING:
            if scheduled:
                return None
            raise ConflictError(f"round {last.number} of task {task_id!r} is still aggregating")
        number = 1 if last is None else last.number + 1
        now = utcnow()
        plan = _plan(task, number, now)
        row = RoundRow(task_id=task_id, number=number, base_version=task.current_version,
                       state=RoundState.OPEN, plan_json=plan.model_dump_json(),
                       quorum=task.quorum, deadline=plan.deadline, opened_at=now,
                       participants=0, upload_bytes=0)
        s.add(row)
        s.flush()
        # After the insert this unit of work holds SQLite's write lock (PostgreSQL: the task
        # row's), so no commit can come between this read and ours.
        committed = s.scalar(select(TaskRow.current_version).where(TaskRow.id == task_id))
        if committed != plan.version:
            raise ConflictError(f"task {task_id!r} moved to v{committed} while round {number} "
                                f"was being planned at v{plan.version}; retry")
        rt.rounds.opened(task_id, row.id, plan, round_cap_of(task))
    if abandoned is not None:
        rt.rounds.finished(abandoned)
    rt.metrics.rounds_opened.inc()
    return plan


def open_round(rt: Runtime, *, task_id: str) -> RoundPlan:
    """Open the task's next round by hand, or return the open one. An `auto` task becomes
    `manual`: whoever opens rounds by hand opens them from now on (`set_schedule` hands the
    task back to the schedule)."""
    plan = _open(rt, task_id, scheduled=False)
    assert plan is not None  # by hand, a round is always opened or returned
    return plan


def open_scheduled(rt: Runtime, *, task_id: str) -> RoundPlan | None:
    """The automatic schedule's next round of the task (None: it is not the schedule's to
    open: the task is `manual`, at its `max_rounds`, or its round is aggregating)."""
    if not rt.settings.auto_open_rounds:
        return None
    try:
        return _open(rt, task_id, scheduled=True)
    except ConflictError:
        return None  # a close committed meanwhile: the next tick plans at the new version


def idle_auto_tasks(s: Session) -> list[str]:
    """`auto` tasks below their `max_rounds` with an enrolled device and no round open or
    aggregating: those whose next round the schedule opens now."""
    busy = select(RoundRow.task_id).where(
        RoundRow.state.in_([RoundState.OPEN, RoundState.AGGREGATING]))
    enrolled = select(DeviceRow.task_id).where(DeviceRow.revoked_at.is_(None))
    return list(s.scalars(select(TaskRow.id).where(
        TaskRow.schedule == Schedule.AUTO, TaskRow.id.not_in(busy), TaskRow.id.in_(enrolled),
        (TaskRow.max_rounds.is_(None)) | (TaskRow.current_version < TaskRow.max_rounds))))


def open_idle(rt: Runtime) -> list[RoundPlan]:
    """Open the next round of every task the automatic schedule runs and that has none open
    (the ticker calls this each tick)."""
    with rt.transaction() as s:
        idle = idle_auto_tasks(s)
    plans = []
    for task_id in idle:
        try:
            plan = open_scheduled(rt, task_id=task_id)
        except Exception as e:  # one task's failure never keeps the others' rounds shut
            why = f"{type(e).__name__}: {e}"
            if rt.open_errors.get(task_id) != why:
                logger.error("task %s: its next round cannot open (%s); retried each tick",
                             task_id, why, exc_info=e)
            rt.open_errors[task_id] = why
            continue
        rt.open_errors.pop(task_id, None)
        if plan is not None:
            plans.append(plan)
    return plans


def set_schedule(rt: Runtime, *, task_id: str, schedule: str | None = None,
                 max_rounds: int | None = None, clear_limit: bool = False) -> None:
    """Who opens the task's rounds from now on (`Schedule`; None keeps it) and the schedule's
    limit (`max_rounds`; `clear_limit` removes it). An `auto` task's next round opens at the
    ticker's next tick."""
    if schedule is not None and schedule not in (Schedule.AUTO, Schedule.MANUAL):
        raise InvalidTaskError(f"schedule must be {Schedule.AUTO!r} or {Schedule.MANUAL!r}, "
                               f"got {schedule!r}")
    if max_rounds is not None and max_rounds < 1:
        raise InvalidTaskError(f"max_rounds must be >= 1, got {max_rounds}")
    with rt.state_lock, rt.transaction() as s:
        task = locked_task(s, task_id)
        if schedule is not None:
            task.schedule = schedule
        if clear_limit:
            task.max_rounds = None
        elif max_rounds is not None:
            task.max_rounds = max_rounds
