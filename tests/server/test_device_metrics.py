"""Device metrics: each device's held-out accuracies per round, stored by one service
function (the Flower strategy's and the REST route's), a repeat replacing the earlier report,
bad reports refused with typed errors, and the fleet's mean and worst decile in the stats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from seedfed.server.coordinator import Coordinator
from seedfed.server.db import downgrade, make_engine, upgrade
from seedfed.server.errors import InvalidMetricsError, NotFoundError, PermissionDeniedError
from seedfed.server.orm import DeviceMetricsRow
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import DeviceMetrics, Upload
from sqlalchemy import func, select

from tests.server.conftest import make_settings
from tests.server.test_api import ADMIN, bearer, enroll, new_task


def metrics(shared: float, personal: float | None = None, local: float | None = None, *,
            version: int = 0, n: int = 48) -> DeviceMetrics:
    return DeviceMetrics(version=version, num_examples=n, shared_accuracy=shared,
                         personal_accuracy=personal, local_accuracy=local)


@pytest.fixture
def any_coord(database_url: str, tmp_path: Path) -> Iterator[Coordinator]:
    """A coordinator on SQLite and on PostgreSQL (the upsert is dialect-specific)."""
    c = Coordinator.open(make_settings(database_url, tmp_path / "store"))
    yield c
    c.close()


def stored(c: Coordinator) -> int:
    with c.rt.transaction() as s:
        return int(s.scalar(select(func.count()).select_from(DeviceMetricsRow)) or 0)


def close_one_round(c: Coordinator, task_id: str, device_id: str) -> None:
    plan = c.open_round(task_id)
    c.submit(task_id, device_id, Upload.build(plan, np.ones((plan.steps, plan.perturbations)),
                                              8, 0.5))
    c.close_round(task_id)


# -- the service ---------------------------------------------------------------------------------
def test_a_report_is_stored_and_a_repeat_replaces_it(any_coord: Coordinator,
                                                     spec: TaskSpec) -> None:
    # Arrange
    c = any_coord
    task_id = c.create_task(spec)
    dev, _ = c.enroll(task_id)
    c.open_round(task_id)

    # Act
    c.record_metrics(task_id, dev, 1, metrics(0.5, 0.75, 0.625))
    c.record_metrics(task_id, dev, 1, metrics(0.5, 0.75, 0.625))  # the same report again
    after_same = [(r.shared_accuracy, r.personal_accuracy) for r in c.device_metrics(task_id, 1)]
    receipt = c.record_metrics(task_id, dev, 1, metrics(0.25))  # scored again: replaces
    (row,) = c.device_metrics(task_id, 1)

    # Assert
    assert after_same == [(0.5, 0.75)]
    assert (row.device_id, row.shared_accuracy, row.personal_accuracy, row.local_accuracy,
            row.num_examples) == (dev, 0.25, None, None, 48)
    assert (receipt.round, receipt.device_id, receipt.version) == (1, dev, 0)
    assert stored(c) == 1


def test_bad_reports_are_refused_with_typed_errors_and_store_nothing(coord: Coordinator,
                                                                     spec: TaskSpec) -> None:
    # Arrange: round 1 closed (v0 -> v1), round 2 open at base v1; a device of another task
    task_id, other = coord.create_task(spec), coord.create_task(spec)
    dev, _ = coord.enroll(task_id)
    gone, _ = coord.enroll(task_id)
    coord.revoke(task_id, gone)
    foreign, _ = coord.enroll(other)
    close_one_round(coord, task_id, dev)
    coord.open_round(task_id)

    # Act / Assert
    with pytest.raises(NotFoundError, match="has no round 7"):
        coord.record_metrics(task_id, dev, 7, metrics(0.5, version=1))
    with pytest.raises(NotFoundError, match="does not exist"):
        coord.record_metrics("nope", dev, 1, metrics(0.5))
    with pytest.raises(InvalidMetricsError, match="v2 for round 2"):
        coord.record_metrics(task_id, dev, 2, metrics(0.5, version=2))  # the task is at v1
    with pytest.raises(InvalidMetricsError, match="v0 for round 2"):
        coord.record_metrics(task_id, dev, 2, metrics(0.5, version=0))  # older than the base
    with pytest.raises(PermissionDeniedError):
        coord.record_metrics(task_id, foreign, 2, metrics(0.5, version=1))
    with pytest.raises(PermissionDeniedError):
        coord.record_metrics(task_id, gone, 2, metrics(0.5, version=1))
    assert stored(coord) == 0
    # a closed round still takes reports: its devices score after it closed
    coord.record_metrics(task_id, dev, 1, metrics(0.5, version=1))
    assert stored(coord) == 1


def test_stats_carry_the_fleets_mean_and_worst_decile_per_round(coord: Coordinator,
                                                                spec: TaskSpec) -> None:
    # Arrange: 10 devices report for round 1, two of them without a personal part; none for 2
    task_id = coord.create_task(spec)
    devices = [coord.enroll(task_id)[0] for _ in range(10)]
    close_one_round(coord, task_id, devices[0])
    shared = [0.5, 0.6, 0.7, 0.4, 0.5, 0.6, 0.7, 0.8, 0.3, 0.9]
    personal = [0.8, 0.9, 0.7, 0.6, 0.85, 0.95, 0.75, 0.9, None, None]
    for d, a, p in zip(devices, shared, personal, strict=True):
        coord.record_metrics(task_id, d, 1, metrics(a, p, None if p is None else 0.6,
                                                    version=1))
    coord.open_round(task_id)

    # Act
    first, second = coord.stats(task_id).rounds

    # Assert
    mine = [p for p in personal if p is not None]
    assert (first.metric_devices, first.personal_devices) == (10, 8)
    assert first.shared_accuracy_mean == pytest.approx(sum(shared) / 10)
    assert first.shared_accuracy_worst_decile == pytest.approx(0.3)
    assert first.personal_accuracy_mean == pytest.approx(sum(mine) / 8)
    assert first.personal_accuracy_worst_decile == pytest.approx(0.6)
    assert first.local_accuracy_mean == pytest.approx(0.6)
    assert (second.metric_devices, second.shared_accuracy_mean,
            second.personal_accuracy_mean) == (0, None, None)


# -- the REST route --------------------------------------------------------------------------------
def _post(client: TestClient, task_id: str, n: int, token: str | None, body: object,
          ) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({} if token is None else bearer(token))}
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post(f"/v1/tasks/{task_id}/rounds/{n}/metrics", headers=headers, **kwargs)
    return r.status_code, r.json()


def test_a_device_reports_over_rest_and_bad_reports_get_their_typed_error(
        client: TestClient, spec: TaskSpec) -> None:
    # Arrange
    task_id, join = new_task(client, spec, quorum=5)
    other, other_join = new_task(client, spec)
    (dev, token), (_, token2) = enroll(client, task_id, join), enroll(client, task_id, join)
    foreign = enroll(client, other, other_join)[1]
    assert client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN).status_code == 201
    good = {"version": 0, "num_examples": 48, "shared_accuracy": 0.5,
            "personal_accuracy": 0.75, "local_accuracy": 0.625}

    # Act
    ok, receipt = _post(client, task_id, 1, token, good)
    again, _ = _post(client, task_id, 1, token, {**good, "personal_accuracy": 1.0})
    _post(client, task_id, 1, token2, {**good, "shared_accuracy": 0.25,
                                       "personal_accuracy": None})
    refused = {
        "accuracy above 1": _post(client, task_id, 1, token, {**good, "shared_accuracy": 1.5}),
        "an example in the body": _post(client, task_id, 1, token, {**good, "text": "hi"}),
        "not JSON": _post(client, task_id, 1, token, b'{"version": '),
        "no token": _post(client, task_id, 1, None, good),
        "admin token": _post(client, task_id, 1, ADMIN["Authorization"][7:], good),
        "device of another task": _post(client, task_id, 1, foreign, good),
        "unknown round": _post(client, task_id, 9, token, good),
        "a version the task never had": _post(client, task_id, 1, token, {**good, "version": 4}),
    }
    stats = client.get(f"/v1/tasks/{task_id}/stats", headers=ADMIN).json()["rounds"][0]

    # Assert
    assert (ok, again) == (200, 200)
    assert (receipt["task_id"], receipt["round"], receipt["device_id"]) == (task_id, 1, dev)
    assert {k: (status, body["error"]) for k, (status, body) in refused.items()} == {
        "accuracy above 1": (422, "RequestValidationError"),
        "an example in the body": (422, "RequestValidationError"),
        "not JSON": (400, "MalformedRequestError"),
        "no token": (401, "AuthenticationError"),
        "admin token": (401, "AuthenticationError"),
        "device of another task": (403, "PermissionDeniedError"),
        "unknown round": (404, "NotFoundError"),
        "a version the task never had": (422, "InvalidMetricsError"),
    }
    assert (stats["metric_devices"], stats["personal_devices"]) == (2, 1)
    assert stats["shared_accuracy_mean"] == pytest.approx(0.375)
    assert stats["shared_accuracy_worst_decile"] == pytest.approx(0.25)
    assert stats["personal_accuracy_mean"] == stats["personal_accuracy_worst_decile"] == 1.0


# -- the migration ---------------------------------------------------------------------------------
def test_the_migration_adds_the_table_to_a_database_with_rounds_and_removes_it_again(
        tmp_path: Path) -> None:
    # Arrange: a database at 0002 with a task, a device and a round
    engine = make_engine(f"sqlite:///{tmp_path / 'old.db'}")
    upgrade(engine, "0002")
    with engine.begin() as c:
        c.execute(sa.text(
            "INSERT INTO tasks (id, name, spec_json, format, quorum, round_timeout_s, "
            "join_token_hash, secret, current_version, scope_numel, created_at) VALUES "
            "('t1', 't1', '{}', 'fp32', 1, 60, 'h', 's', 1, 1, '2026-01-01 00:00:00')"))
        c.execute(sa.text("INSERT INTO devices (id, task_id, token_hash, created_at) VALUES "
                          "('d1', 't1', 'x', '2026-01-01 00:00:00')"))
        c.execute(sa.text(
            "INSERT INTO rounds (id, task_id, number, base_version, state, plan_json, quorum, "
            "deadline, opened_at, participants, upload_bytes) VALUES (1, 't1', 1, 0, 'closed', "
            "'{}', 1, '2026-01-01 00:10:00', '2026-01-01 00:00:00', 1, 0)"))

    # Act
    upgrade(engine, "head")
    with engine.begin() as c:
        c.execute(sa.text(
            "INSERT INTO device_metrics (round_id, device_id, version, num_examples, "
            "shared_accuracy, personal_accuracy, local_accuracy, reported_at) VALUES "
            "(1, 'd1', 1, 48, 0.5, 0.75, NULL, '2026-01-01 00:11:00')"))
        duplicate = c.begin_nested()
        with pytest.raises(sa.exc.IntegrityError):  # one row per device and round
            c.execute(sa.text(
                "INSERT INTO device_metrics (round_id, device_id, version, num_examples, "
                "shared_accuracy, reported_at) VALUES (1, 'd1', 1, 48, 0.1, "
                "'2026-01-01 00:12:00')"))
        duplicate.rollback()
        kept = c.execute(sa.text("SELECT shared_accuracy FROM device_metrics")).scalars().all()
    downgrade(engine, "0002")
    tables = set(sa.inspect(engine).get_table_names())
    with engine.connect() as c:
        rounds = c.execute(sa.text("SELECT count(*) FROM rounds")).scalar()
    engine.dispose()

    # Assert
    assert kept == [0.5]
    assert "device_metrics" not in tables and rounds == 1
