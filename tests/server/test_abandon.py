"""No task can be wedged: a round close that fails on every attempt says so instead of retrying
forever, and an operator abandons the round (`service.abandon_round`, `POST .../abandon`) so
the task goes on from its committed version; abandoning is well defined against a close in
progress and after a crash mid-close (docs/design.md, "Crash-safe round close")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load as st_load
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.errors import (
    ConflictError,
    DatabaseUnavailableError,
    NotFoundError,
    RoundClosedError,
    StoreError,
    fails_every_time,
)
from seedfed.server.orm import RoundRow, RoundState
from seedfed.server.runtime import Runtime
from seedfed.server.service import abandon as abandon_service
from seedfed.server.service import rounds as rounds_service
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.protocol.errors import NonFiniteScalarError, ShapeError
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload
from sqlalchemy import select, update

from tests.server.conftest import make_settings
from tests.server.test_api import ADMIN

Factory = Callable[[], Coordinator]


@pytest.fixture
def open_coord(database_url: str, tmp_path: Path) -> Iterator[Factory]:
    """Coordinators on one database and store (a second one is a restart)."""
    opened: list[Coordinator] = []

    def factory() -> Coordinator:
        c = Coordinator.open(make_settings(database_url, tmp_path / "store",
                                           close_retry_base_s=0.01, close_retry_max_s=0.02))
        opened.append(c)
        return c

    yield factory
    for c in opened:
        c.close()


def upload(plan: RoundPlan, seed: int) -> Upload:
    g = np.random.default_rng(seed).normal(size=(plan.steps, plan.perturbations))
    return Upload.build(plan, g, 8, 0.5)


def non_finite(*_args: Any, **_kw: Any) -> Any:
    """Stands in for the aggregation of a round whose update overflows float32 (what a task
    created with lr=1e37 before hyperparameters had ranges produced)."""
    raise NonFiniteScalarError("the round's update coefficients are not finite")


def wedge(c: Coordinator, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> str:
    """A task whose round 1 is `aggregating` with a close that fails on every attempt."""
    task_id = c.create_task(spec)
    devices = [c.enroll(task_id)[0] for _ in range(2)]
    plan = c.open_round(task_id)
    for i, d in enumerate(devices):
        c.submit(task_id, d, upload(plan, i))
    monkeypatch.setattr(rounds_service, "combine", non_finite)
    with pytest.raises(NonFiniteScalarError):
        c.close_round(task_id)
    return task_id


def round_states(c: Coordinator, task_id: str) -> list[tuple[int, str]]:
    with c.rt.transaction() as s:
        return [(r.number, r.state) for r in s.scalars(
            select(RoundRow).where(RoundRow.task_id == task_id).order_by(RoundRow.number))]


# -- a close that fails on every attempt ---------------------------------------------------------
@pytest.mark.parametrize("exc, permanent", [
    (NonFiniteScalarError("inf"), True), (ShapeError("2 x 3"), True),
    (ZeroDivisionError("0"), True), (ValueError("bad row"), True),
    (DatabaseUnavailableError("down"), False), (StoreError("file missing"), False),
    (OSError(28, "No space left on device"), False), (RuntimeError("flaky load"), False),
    (MemoryError(), False)])
def test_deterministic_close_errors_are_told_from_transient_ones(exc: BaseException,
                                                                 permanent: bool) -> None:
    assert fails_every_time(exc) is permanent


def test_a_deterministic_failure_is_reported_once_and_not_retried(
        open_coord: Factory, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange
    c = open_coord()
    task_id = wedge(c, spec, monkeypatch)
    calls: list[int] = []

    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        return non_finite(*args, **kw)

    monkeypatch.setattr(rounds_service, "combine", counted)

    # Act: ticks well past any backoff
    for _ in range(5):
        time.sleep(0.03)
        c.tick()
    status = c.task_status(task_id)

    # Assert: one failed attempt, no retry scheduled, the operator named
    assert calls == [] and status.close_attempts == 1
    assert status.close_permanent and status.close_retry_at is None
    assert status.state == "aggregating" and status.waiting_for == "operator"
    assert status.waiting is not None and f"seedfed round abandon {task_id} 1" in status.waiting
    assert "NonFiniteScalarError" in (status.close_error or "")


def test_a_restart_tries_a_deterministic_failure_once_more_then_waits(
        open_coord: Factory, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange
    c = open_coord()
    task_id = wedge(c, spec, monkeypatch)
    c.close()

    # Act: a restart's recovery, then ticks
    c2 = open_coord()
    for _ in range(3):
        time.sleep(0.03)
        c2.tick()

    # Assert
    status = c2.task_status(task_id)
    assert (status.state, status.close_attempts, status.close_permanent) == (
        "aggregating", 1, True)


def test_abandoning_a_wedged_round_lets_the_task_go_on_from_its_version(
        open_coord: Factory, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: wedged, then the cause is gone (the next round aggregates normally)
    c = open_coord()
    task_id = wedge(c, spec, monkeypatch)
    with pytest.raises(ConflictError, match="still aggregating"):
        c.open_round(task_id)
    monkeypatch.undo()

    # Act
    out = c.abandon_round(task_id, 1, "  lr=1e37 overflows every update  ")
    plan = c.open_round(task_id)
    dev = c.enroll(task_id)[0]
    c.submit(task_id, dev, upload(plan, 9))
    entry = c.close_round(task_id)

    # Assert: the reason kept and shown; round 2 planned at v0; the failure forgotten
    status = c.task_status(task_id)
    assert (out.round, out.base_version, out.version, out.uploads) == (1, 0, 0, 2)
    assert out.reason == "lr=1e37 overflows every update"
    assert (plan.round, plan.version, entry.base_version, status.version) == (2, 0, 0, 1)
    assert (status.abandoned_round, status.abandon_reason) == (1, out.reason)
    assert status.close_error is None and len(c.rt.close_failures) == 0
    assert round_states(c, task_id) == [(1, RoundState.ABANDONED), (2, RoundState.CLOSED)]
    assert c.round_metrics(task_id)[0].abandon_reason == out.reason


def test_an_abandoned_open_round_refuses_its_uploads_and_only_open_rounds_can_go(
        open_coord: Factory, spec: TaskSpec) -> None:
    # Arrange
    c = open_coord()
    task_id = c.create_task(spec)
    dev = c.enroll(task_id)[0]
    plan = c.open_round(task_id)

    # Act
    c.abandon_round(task_id, 1, "wrong data announced")

    # Assert
    with pytest.raises(RoundClosedError):
        c.submit(task_id, dev, upload(plan, 1))
    with pytest.raises(RoundClosedError, match="abandoned"):
        c.abandon_round(task_id, 1, "again")
    with pytest.raises(NotFoundError):
        c.abandon_round(task_id, 7, "no such round")
    assert c.current_plan(task_id) is None and c.open_round(task_id).round == 2


# -- against a close in progress, and after a crash ----------------------------------------------
def test_abandon_waits_for_a_close_in_progress_and_finds_it_committed(
        open_coord: Factory, spec: TaskSpec) -> None:
    # Arrange: a close held mid-aggregation
    c = open_coord()
    task_id = c.create_task(spec)
    dev = c.enroll(task_id)[0]
    c.submit(task_id, dev, upload(c.open_round(task_id), 1))
    entered, release = threading.Event(), threading.Event()

    def hold(_seed: int) -> None:
        entered.set()
        release.wait(30)

    c.rt.faults.mid_aggregation = hold
    closer = threading.Thread(target=c.close_round, args=(task_id,))
    closer.start()
    assert entered.wait(30)

    # Act: while it runs, then once it committed
    with pytest.raises(ConflictError, match="being closed right now"):
        abandon_service.abandon_round(c.rt, task_id=task_id, number=1, reason="x", wait_s=0.1)
    c.rt.faults.mid_aggregation = None
    release.set()
    closer.join(30)

    # Assert: the close won; nothing to abandon
    with pytest.raises(RoundClosedError, match="made v1"):
        c.abandon_round(task_id, 1, "too late")
    assert c.task_status(task_id).version == 1


def test_a_close_never_commits_a_round_abandoned_during_it(
        open_coord: Factory, spec: TaskSpec, tmp_path: Path) -> None:
    # Arrange: between the close's file writes and its commit, the round is abandoned in the
    # database (as by another process: the task lock does not reach it)
    c = open_coord()
    task_id = c.create_task(spec)
    dev = c.enroll(task_id)[0]
    c.submit(task_id, dev, upload(c.open_round(task_id), 1))

    def abandon_in_the_database() -> None:
        with c.rt.engine.begin() as conn:
            conn.execute(update(RoundRow).where(RoundRow.task_id == task_id).values(
                state=RoundState.ABANDONED, abandon_reason="elsewhere"))

    c.rt.faults.after_files = abandon_in_the_database

    # Act
    with pytest.raises(ConflictError, match="abandoned during its close"):
        c.close_round(task_id)
    c.rt.faults.after_files = None
    c.rt.rounds.invalidate()
    plan = c.open_round(task_id)
    c.submit(task_id, dev, upload(plan, 2))
    entry = c.close_round(task_id)

    # Assert: v1 came from round 2 alone (the abandoned close's v1 files were replaced), and
    # a replay of v0 + the log reaches the snapshot's checksum
    status = c.task_status(task_id)
    device = build_model(spec, initialize=False)
    device.scope.write(st_load(c.snapshot(task_id, 0)[0]))
    replay(device.scope, [e.to_entry() for e in c.log_since(task_id, 0)], task_id=task_id,
           version=0)
    data, chk = c.snapshot(task_id, 1)
    assert (plan.round, plan.version, status.version) == (2, 0, 1)
    assert checksum(device.scope) == entry.checksum == chk == status.checksum
    assert round_states(c, task_id) == [(1, RoundState.ABANDONED), (2, RoundState.CLOSED)]


class Crash(Exception):
    pass


def test_a_round_left_by_a_crash_mid_close_can_be_abandoned_when_recovery_fails(
        open_coord: Factory, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: a crash after the close wrote v1's files; at the restart the recovery fails on
    # every attempt (the aggregation overflows)
    c = open_coord()
    task_id = c.create_task(spec)
    dev = c.enroll(task_id)[0]
    c.submit(task_id, dev, upload(c.open_round(task_id), 1))

    def crash() -> None:
        raise Crash("simulated crash")

    c.rt.faults.after_files = crash
    with pytest.raises(Crash):
        c.close_round(task_id)
    c.close()
    monkeypatch.setattr(rounds_service, "combine", non_finite)
    c2 = open_coord()
    stuck = c2.task_status(task_id)
    monkeypatch.undo()

    # Act
    c2.abandon_round(task_id, 1, "recovery overflows")
    plan = c2.open_round(task_id)
    c2.submit(task_id, dev, upload(plan, 5))
    entry = c2.close_round(task_id)

    # Assert: the crashed close's v1 never became the task's; the new v1 replays bit for bit
    assert (stuck.state, stuck.close_permanent) == ("aggregating", True)
    device = build_model(spec, initialize=False)
    device.scope.write(st_load(c2.snapshot(task_id, 0)[0]))
    replay(device.scope, [entry.to_entry()], task_id=task_id, version=0)
    assert checksum(device.scope) == entry.checksum == c2.snapshot(task_id, 1)[1]
    assert c2.task_status(task_id).version == 1


# -- over HTTP: the route, /readyz, the task status ----------------------------------------------
@pytest.fixture
def app_client(sqlite_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = make_settings(sqlite_url, tmp_path / "store", tick_interval_s=0.02,
                             close_retry_base_s=0.01, close_retry_max_s=0.02)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        yield client


def test_the_abandon_route_unwedges_a_task_and_readyz_says_why_it_was_stuck(
        app_client: TestClient, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: a wedged task in the running app
    rt: Runtime = app_client.app.state.runtime  # type: ignore[attr-defined]
    c = Coordinator(rt)
    task_id = wedge(c, spec, monkeypatch)  # (the ticker may have tried it at quorum too)
    tried = c.task_status(task_id).close_attempts
    time.sleep(0.2)  # a few ticks: none retries it
    ready = app_client.get("/readyz").json()
    opening = app_client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)
    blank = app_client.post(f"/v1/tasks/{task_id}/rounds/1/abandon", headers=ADMIN,
                            json={"reason": "   "})

    # Act
    done = app_client.post(f"/v1/tasks/{task_id}/rounds/1/abandon", headers=ADMIN,
                           json={"reason": "non-finite update"})
    again = app_client.post(f"/v1/tasks/{task_id}/rounds/1/abandon", headers=ADMIN,
                            json={"reason": "non-finite update"})
    status = app_client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()

    # Assert
    (failing,) = ready["failing_closes"]
    assert ready["status"] == "degraded" and "fails on every attempt" in ready["detail"]
    assert failing["permanent"] and failing["retry_at"] is None
    assert failing["attempts"] == tried
    assert opening.status_code == 409 and blank.status_code == 422
    assert done.status_code == 200, done.text
    assert done.json()["reason"] == "non-finite update" and done.json()["uploads"] == 2
    assert again.status_code == 409 and again.json()["error"] == "RoundClosedError"
    assert (status["abandoned_round"], status["abandon_reason"]) == (1, "non-finite update")
    assert status["close_error"] is None and status["state"] == "idle"
    assert app_client.get("/readyz").json()["status"] == "ok"
