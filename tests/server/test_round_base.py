"""A round is only ever opened at the task's committed version (a close that commits between
open_round's read of the task row and its read of the latest round must not open the next
round at the old version, which recovery would refuse at every start, leaving the task stuck),
and a round planned at a stale base is abandoned instead of being left `aggregating` forever."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from seedfed.server.coordinator import Coordinator
from seedfed.server.errors import ConflictError, RoundClosedError
from seedfed.server.orm import RoundRow, RoundState
from seedfed.server.service import rounds as rounds_service
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload
from sqlalchemy import event, select

from tests.server.conftest import make_settings


@pytest.fixture
def coord(database_url: str, tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator.open(make_settings(database_url, tmp_path / "store"))
    yield c
    c.close()


def upload(plan: RoundPlan, seed: int) -> Upload:
    g = np.random.default_rng(seed).normal(size=(plan.steps, plan.perturbations))
    return Upload.build(plan, g, 8, 0.5)


def rounds_of(coord: Coordinator, task_id: str) -> list[tuple[int, int, str]]:
    with coord.rt.transaction() as s:
        return [(r.number, r.base_version, r.state) for r in s.scalars(
            select(RoundRow).where(RoundRow.task_id == task_id).order_by(RoundRow.number))]


def run_between_reads(action: Any, *, after: int = 1) -> Any:
    """A `do_orm_execute` hook that runs `action` in another thread, to its end, right after
    statement number `after` of this thread's next unit of work (the rows fetched and the
    cursor closed first): the interleavings the crash campaign hit by chance."""
    me = threading.get_ident()
    seen = [0]

    def hook(state: Any) -> Any:
        if seen[0] >= after or threading.get_ident() != me:
            return None
        seen[0] += 1
        frozen = state.invoke_statement().freeze()
        if seen[0] == after:
            t = threading.Thread(target=action)
            t.start()
            t.join(timeout=120)
        return frozen()

    return hook


def test_a_close_committing_during_open_round_cannot_leave_a_stale_base(
        coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: round 1 is aggregating (unit of work 1 of its close done), v0 committed
    task_id = coord.create_task(spec, quorum=1)
    device, _ = coord.enroll(task_id)
    plan = coord.open_round(task_id)
    coord.submit(task_id, device, upload(plan, 1))
    rid = rounds_service._begin_close(coord.rt, task_id, None, None)
    hook = run_between_reads(lambda: rounds_service._finish(coord.rt, task_id, rid))
    event.listen(coord.rt.sessions, "do_orm_execute", hook)

    # Act: the close commits v1 while open_round is between its reads
    try:
        try:
            opened: RoundPlan | None = coord.open_round(task_id)
        except ConflictError:  # it saw round 1 still aggregating: refused, nothing opened
            opened = None
    finally:
        event.remove(coord.rt.sessions, "do_orm_execute", hook)
    again = coord.open_round(task_id)

    # Assert: the close committed v1, and round 2 was planned at v1, never at v0
    assert coord.task_status(task_id).version == 1
    assert opened is None or opened.version == 1
    assert (again.round, again.version) == (2, 1)
    assert rounds_of(coord, task_id) == [(1, 0, RoundState.CLOSED), (2, 1, RoundState.OPEN)]
    # ... and it closes: a new version, not a round refused at every start
    coord.submit(task_id, device, upload(again, 2))
    assert coord.close_round(task_id).base_version == 1
    assert coord.task_status(task_id).version == 2


def stale_round(coord: Coordinator, task_id: str, device: str, *, state: str) -> RoundPlan:
    """Round 2 at base v0 while the task is at v1 (what the race left), with one upload."""
    plan = coord.open_round(task_id)
    coord.submit(task_id, device, upload(plan, 1))
    coord.close_round(task_id)  # v1
    stale = coord.open_round(task_id).model_copy(update={"version": 0})
    coord.submit(task_id, device, upload(stale.model_copy(update={"version": 1}), 2))
    with coord.rt.transaction() as s:
        row = s.scalars(select(RoundRow).where(RoundRow.task_id == task_id,
                                               RoundRow.number == 2)).one()
        row.base_version, row.plan_json, row.state = 0, stale.model_dump_json(), state
    coord.rt.rounds.invalidate()
    return stale


def test_recovery_abandons_an_aggregating_round_planned_at_a_stale_base(
        coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: round 2 stuck `aggregating` at v0, the task at v1
    task_id = coord.create_task(spec, quorum=1)
    device, _ = coord.enroll(task_id)
    stale = stale_round(coord, task_id, device, state=RoundState.AGGREGATING)

    # Act: a restart's recovery, then the ticker's automatic schedule (opening rounds by
    # hand above made the task manual: hand it back first)
    coord.set_schedule(task_id, "auto")
    recovered = rounds_service.recover(coord.rt)
    rounds_service.tick(coord.rt, auto_open=True)

    # Assert: abandoned (no new version, nothing left to retry), round 3 open at v1
    status = coord.task_status(task_id)
    assert recovered == [] and status.version == 1
    assert status.close_error is None and status.state == "open" and status.round == 3
    assert rounds_of(coord, task_id) == [(1, 0, RoundState.CLOSED),
                                         (2, 0, RoundState.ABANDONED), (3, 1, RoundState.OPEN)]
    assert [m.state for m in coord.round_metrics(task_id)] == ["closed", "abandoned", "open"]
    with pytest.raises(RoundClosedError):  # its uploads are refused
        coord.submit(task_id, coord.enroll(task_id)[0], upload(stale, 3))


def test_an_open_round_planned_at_a_stale_base_is_replanned(
        coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: round 2 open at v0 (uploads would be computed at the wrong base)
    task_id = coord.create_task(spec, quorum=1)
    device, _ = coord.enroll(task_id)
    stale_round(coord, task_id, device, state=RoundState.OPEN)

    # Act
    plan = coord.open_round(task_id)

    # Assert
    assert (plan.round, plan.version) == (3, 1)
    assert rounds_of(coord, task_id)[1:] == [(2, 0, RoundState.ABANDONED),
                                             (3, 1, RoundState.OPEN)]
    coord.submit(task_id, device, upload(plan, 4))
    assert coord.close_round(task_id).base_version == 1


def test_a_round_opened_during_a_plan_cache_miss_stays_cached(
        coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: round 1 closed, no round open, the plan cache empty (e.g. after a restart)
    task_id = coord.create_task(spec, quorum=1)
    device, _ = coord.enroll(task_id)
    coord.submit(task_id, device, upload(coord.open_round(task_id), 1))
    coord.close_round(task_id)
    coord.rt.rounds.invalidate()
    opened: list[RoundPlan] = []
    hook = run_between_reads(lambda: opened.append(coord.open_round(task_id)), after=2)
    event.listen(coord.rt.sessions, "do_orm_execute", hook)

    # Act: round 2 opens after the miss read "no open round", before it was cached
    try:
        seen = coord.current_plan(task_id)
    finally:
        event.remove(coord.rt.sessions, "do_orm_execute", hook)

    # Assert: the cache holds round 2, not the older read's "none open"
    assert [p.round for p in opened] == [2]
    assert coord.current_plan(task_id) == opened[0]
    assert seen is None or seen == opened[0]
    coord.submit(task_id, device, upload(opened[0], 2))  # not "round 2 is open, not open"
