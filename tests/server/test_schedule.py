"""Rounds run themselves: a task created over REST runs its rounds back to back (the first once
a device enrolled) until its round limit; opening a round by hand takes the task over; the
task's status says what it waits for (`service/opening.py`, `service/waiting.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from seedfed.server.app import create_app
from seedfed.server.caches import CloseFailure
from seedfed.server.coordinator import Coordinator
from seedfed.server.orm import utcnow
from seedfed.server.service.waiting import TaskMoment, waiting_of
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload

from tests.server.conftest import make_settings
from tests.server.test_api import ADMIN, bearer, enroll, new_task


@pytest.fixture
def make_client(sqlite_url: str, tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(**over: object) -> TestClient:
        settings = make_settings(sqlite_url, tmp_path / "store", tick_interval_s=0.02, **over)
        c = TestClient(create_app(settings), raise_server_exceptions=False)
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def status(client: TestClient, task_id: str) -> dict:
    r = client.get(f"/v1/tasks/{task_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def current(client: TestClient, task_id: str) -> RoundPlan | None:
    r = client.get(f"/v1/tasks/{task_id}/rounds/current", headers=ADMIN)
    return RoundPlan.model_validate(r.json()) if r.status_code == 200 else None


def upload(client: TestClient, plan: RoundPlan, token: str, seed: int) -> None:
    g = np.random.default_rng(seed).normal(size=(plan.steps, plan.perturbations))
    body = Upload.build(plan, g, 8, 0.5).model_dump_json()
    r = client.post(f"/v1/tasks/{plan.task_id}/rounds/{plan.round}/uploads", content=body,
                    headers={**bearer(token), "Content-Type": "application/json"})
    assert r.status_code == 200, r.text


def rounds(client: TestClient, task_id: str) -> list[tuple[int, str]]:
    r = client.get(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)
    return [(m["round"], m["state"]) for m in r.json()]


def test_a_rest_task_runs_its_rounds_by_itself_until_its_round_limit(
        make_client: Callable[..., TestClient], spec: TaskSpec) -> None:
    # Arrange: a task with the default schedule and a limit of 3 rounds, no device yet
    client = make_client()
    task_id, join = new_task(client, spec, quorum=1, max_rounds=3)
    time.sleep(0.1)  # ticks: nothing to open without a device
    before = status(client, task_id)

    # Act: one device enrolls and uploads to every round the coordinator opens
    _, token = enroll(client, task_id, join)
    def at_round(n: int) -> Callable[[], bool]:
        return lambda: getattr(current(client, task_id), "round", 0) == n

    for n in (1, 2, 3):
        wait_for(f"round {n}", at_round(n))
        plan = current(client, task_id)
        assert plan is not None
        upload(client, plan, token, n)  # at quorum: closes, and the next opens
    wait_for("version 3", lambda: status(client, task_id)["version"] == 3)
    time.sleep(0.15)  # more ticks: the limit holds
    after = status(client, task_id)

    # Assert
    assert (before["schedule"], before["max_rounds"], before["round"]) == ("auto", 3, None)
    assert before["waiting_for"] == "devices" and "enrolls" in before["waiting"]
    assert (after["version"], after["round"], after["state"]) == (3, 3, "idle")
    assert after["waiting_for"] == "round_limit" and "max_rounds 3" in after["waiting"]
    assert rounds(client, task_id) == [(1, "closed"), (2, "closed"), (3, "closed")]


def test_an_open_round_says_how_many_uploads_it_waits_for_and_until_when(
        make_client: Callable[..., TestClient], spec: TaskSpec) -> None:
    # Arrange
    client = make_client()
    task_id, join = new_task(client, spec, quorum=2, round_timeout_s=600.0)
    tokens = [enroll(client, task_id, join)[1] for _ in range(3)]
    wait_for("round 1", lambda: current(client, task_id) is not None)
    plan = current(client, task_id)
    assert plan is not None

    # Act
    upload(client, plan, tokens[0], 1)
    s = status(client, task_id)

    # Assert
    assert (s["state"], s["uploads"], s["waiting_for"]) == ("open", 1, "uploads")
    assert "1 of 2 uploads" in s["waiting"] and "3 device(s) enrolled" in s["waiting"]
    assert s["deadline"] is not None and "deadline" in s["waiting"]


def test_opening_a_round_by_hand_takes_the_task_over_until_it_is_handed_back(
        make_client: Callable[..., TestClient], spec: TaskSpec) -> None:
    # Arrange: the schedule opened round 1
    client = make_client()
    task_id, join = new_task(client, spec, quorum=1)
    _, token = enroll(client, task_id, join)
    wait_for("round 1", lambda: current(client, task_id) is not None)

    # Act: an operator (or a Flower ServerApp) opens by hand: it gets the open round
    by_hand = client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)
    upload(client, RoundPlan.model_validate(by_hand.json()), token, 1)
    wait_for("version 1", lambda: status(client, task_id)["version"] == 1)
    time.sleep(0.15)
    held = status(client, task_id)
    handed = client.patch(f"/v1/tasks/{task_id}/schedule", headers=ADMIN,
                          json={"schedule": "auto", "max_rounds": 5})
    wait_for("round 2", lambda: current(client, task_id) is not None)
    cleared = client.patch(f"/v1/tasks/{task_id}/schedule", headers=ADMIN,
                           json={"max_rounds": None})

    # Assert: no round opened beside the hand-opened one; the schedule resumed when asked
    assert by_hand.status_code == 201 and by_hand.json()["round"] == 1
    assert (held["schedule"], held["round"], held["state"]) == ("manual", 1, "idle")
    assert held["waiting_for"] == "operator" and "seedfed round open" in held["waiting"]
    assert handed.status_code == 200 and (handed.json()["schedule"],
                                          handed.json()["max_rounds"]) == ("auto", 5)
    assert getattr(current(client, task_id), "round", None) == 2
    assert cleared.json()["max_rounds"] is None and cleared.json()["schedule"] == "auto"


def test_a_manual_task_and_a_coordinator_without_schedules_wait_for_an_operator(
        make_client: Callable[..., TestClient], spec: TaskSpec) -> None:
    # Arrange
    client = make_client(auto_open_rounds=False)
    auto, join = new_task(client, spec)
    manual, join2 = new_task(client, spec, schedule="manual")
    enroll(client, auto, join)
    enroll(client, manual, join2)

    # Act
    time.sleep(0.15)
    a, m = status(client, auto), status(client, manual)

    # Assert
    assert (a["round"], m["round"]) == (None, None)
    assert a["waiting_for"] == m["waiting_for"] == "operator"
    assert "auto_open_rounds" in a["waiting"] and "round open" in m["waiting"]


def test_schedule_requests_are_checked(make_client: Callable[..., TestClient],
                                       spec: TaskSpec) -> None:
    client = make_client()
    task_id, _ = new_task(client, spec, schedule="manual")

    bad = client.patch(f"/v1/tasks/{task_id}/schedule", headers=ADMIN, json={"schedule": "x"})
    zero = client.patch(f"/v1/tasks/{task_id}/schedule", headers=ADMIN, json={"max_rounds": 0})
    unknown = client.patch("/v1/tasks/nope/schedule", headers=ADMIN, json={})
    anon = client.patch(f"/v1/tasks/{task_id}/schedule", json={})
    create = client.post("/v1/tasks", headers=ADMIN, json={"spec": spec.to_dict(),
                                                             "schedule": "sometimes"})

    assert (bad.status_code, zero.status_code, create.status_code) == (422, 422, 422)
    assert (unknown.status_code, anon.status_code) == (404, 401)


def test_the_in_process_facade_opens_its_own_rounds(sqlite_url: str, tmp_path: Path,
                                                    spec: TaskSpec) -> None:
    # Its callers (simulate, the Flower ServerApp in process) open every round themselves.
    with Coordinator.open(make_settings(sqlite_url, tmp_path / "store")) as c:
        task_id = c.create_task(spec)
        c.enroll(task_id)
        c.tick()

        s = c.task_status(task_id)
        assert (s.schedule, s.round, s.waiting_for) == ("manual", None, "operator")


def _moment(**over: object) -> TaskMoment:
    now = utcnow()
    base: dict[str, object] = dict(
        task_id="t", state="idle", round=4, uploads=0, quorum=2, deadline=None, devices=3,
        version=4, schedule="auto", max_rounds=None, schedule_on=True, failure=None, now=now)
    base.update(over)
    return TaskMoment(**base)


def test_waiting_names_a_failing_close_first_then_the_round_then_the_schedule() -> None:
    now = utcnow()
    retried = CloseFailure(round_id=9, round=4, attempts=2, error="RuntimeError: x",
                           failed_at=now, retry_at=now + timedelta(seconds=30))
    stuck = CloseFailure(round_id=9, round=4, attempts=1, error="NonFiniteScalarError: inf",
                         failed_at=now, retry_at=None, permanent=True)

    cases = {
        "close_retry": _moment(state="aggregating", failure=retried),
        "operator": _moment(state="aggregating", failure=stuck),
        "aggregation": _moment(state="aggregating"),
        "uploads": _moment(state="open", uploads=1, deadline=now + timedelta(minutes=5)),
        "round_limit": _moment(max_rounds=4),
        "devices": _moment(devices=0),
        "schedule": _moment(),
    }

    for keyword, moment in cases.items():
        got, line = waiting_of(moment)
        assert got == keyword, (keyword, line)
        assert line
    assert "in 30 s" in waiting_of(cases["close_retry"])[1]
    assert "abandon" in waiting_of(cases["operator"])[1]
    assert "in 5 min 0 s" in waiting_of(cases["uploads"])[1]


# -- the migration ---------------------------------------------------------------------------------
def test_the_migration_keeps_existing_tasks_manual_and_removes_its_columns_again(
        database_url: str) -> None:
    import sqlalchemy as sa
    from seedfed.server.db import downgrade, make_engine, upgrade

    # Arrange: a database at 0003 with a task, a device and a round (rounds were opened by hand)
    engine = make_engine(database_url)
    upgrade(engine, "0003")
    with engine.begin() as c:
        c.execute(sa.text(
            "INSERT INTO tasks (id, name, spec_json, format, quorum, round_timeout_s, "
            "join_token_hash, secret, current_version, scope_numel, created_at) VALUES "
            "('t1', 't1', '{}', 'fp32', 1, 60, 'h', 's', 1, 1, '2026-01-01 00:00:00+00')"))
        c.execute(sa.text("INSERT INTO devices (id, task_id, token_hash, created_at) VALUES "
                          "('d1', 't1', 'x', '2026-01-01 00:00:00+00')"))
        c.execute(sa.text(
            "INSERT INTO rounds (task_id, number, base_version, state, plan_json, quorum, "
            "deadline, opened_at, participants, upload_bytes) VALUES ('t1', 1, 0, 'closed', "
            "'{}', 1, '2026-01-01 00:10:00+00', '2026-01-01 00:00:00+00', 1, 0)"))

    # Act
    upgrade(engine, "head")
    with engine.connect() as c:
        upgraded = c.execute(sa.text("SELECT schedule, max_rounds FROM tasks")).one()
        reason = c.execute(sa.text("SELECT abandon_reason FROM rounds")).scalar()
    downgrade(engine, "0003")
    columns = {c["name"] for c in sa.inspect(engine).get_columns("tasks")}
    with engine.connect() as c:
        kept = [c.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar()
                for t in ("tasks", "devices", "rounds")]
    upgrade(engine, "head")
    engine.dispose()

    # Assert: an upgrade never starts rounds by itself; the downgrade loses no row
    assert tuple(upgraded) == ("manual", None) and reason is None
    assert not {"schedule", "max_rounds"} & columns and kept == [1, 1, 1]


def test_a_task_whose_round_cannot_open_never_keeps_the_others_shut(
        sqlite_url: str, tmp_path: Path, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from seedfed.server.service import opening
    from seedfed.server.service import rounds as rounds_service

    with Coordinator.open(make_settings(sqlite_url, tmp_path / "store")) as c:
        # Arrange: two automatic tasks with a device each; the first one's plan cannot be made
        broken, fine = (c.create_task(spec, schedule="auto") for _ in range(2))
        for t in (broken, fine):
            c.enroll(t)
        real = opening._plan

        def plan(task: Any, number: int, now: Any) -> Any:
            if task.id == broken:
                raise ValueError("stored spec cannot be planned")
            return real(task, number, now)

        monkeypatch.setattr(opening, "_plan", plan)

        # Act: three ticks
        for _ in range(3):
            rounds_service.tick(c.rt, auto_open=True)

        # Assert: the other task's round opened; the failure logged once
        assert (c.task_status(fine).round, c.task_status(broken).round) == (1, None)
        logged = [r for r in caplog.records if "cannot open" in r.getMessage()]
        assert len(logged) == 1 and broken in logged[0].getMessage()
