"""A round close that fails is retried with backoff, surfaced, and never blocks other tasks;
stored uploads outside the current bounds cannot fail a close."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.runtime import Runtime
from seedfed.server.service import rounds as rounds_service
from seedfed.server.service.uploads import PendingUpload, write_uploads
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload

from tests.server.conftest import make_settings

ADMIN = {"Authorization": "Bearer admin-" + "x" * 20}


@pytest.fixture
def coord(sqlite_url: str, tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator.open(make_settings(sqlite_url, tmp_path / "store", close_retry_base_s=0.05,
                                       close_retry_max_s=0.2))
    yield c
    c.close()


def g(plan: RoundPlan, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(plan.steps, plan.perturbations))


def store_unchecked(rt: Runtime, task_id: str, device_id: str, plan: RoundPlan, *,
                    loss: float) -> None:
    """Store an upload the way a coordinator without bounds did (no validation)."""
    hit = rt.rounds.plan(task_id)
    assert hit is not None
    m = np.ones((plan.steps, plan.perturbations), dtype=np.float32)
    (out,) = write_uploads(rt, [PendingUpload(
        task_id=task_id, round_id=hit[0], round=plan.round, device_id=device_id, matrix=m,
        num_examples=4, loss=loss, digest=f"legacy-{device_id}", wire_bytes=100)])
    assert not isinstance(out, Exception)


class Flaky:
    """Stands in for `load_master`: fails for the tasks in `failing`, else the real one."""

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.real = rounds_service.load_master

    def __call__(self, rt: Runtime, *, task_id: str) -> object:
        if task_id in self.failing:
            raise RuntimeError(f"transient model load failure of {task_id}")
        return self.real(rt, task_id=task_id)


def test_stored_extreme_losses_cannot_fail_a_close(coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: two rows a coordinator without bounds accepted (their sum overflowed fsum)
    task_id = coord.create_task(spec)
    honest, big, small = (coord.enroll(task_id)[0] for _ in range(3))
    plan = coord.open_round(task_id)
    coord.submit(task_id, honest, Upload.build(plan, g(plan, 1), 10, 0.5))
    store_unchecked(coord.rt, task_id, big, plan, loss=1e308)
    store_unchecked(coord.rt, task_id, small, plan, loss=-1e308)

    # Act
    entry = coord.close_round(task_id)

    # Assert: closed from the honest upload alone
    (metrics,) = coord.round_metrics(task_id)
    assert entry.base_version == 0 and coord.task_status(task_id).version == 1
    assert metrics.participants == 1 and metrics.loss == 0.5


def test_a_failed_close_is_retried_with_backoff_until_it_succeeds(
        coord: Coordinator, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: a round whose close fails (a transient error while loading the model)
    task_id = coord.create_task(spec)
    dev = coord.enroll(task_id)[0]
    plan = coord.open_round(task_id)
    coord.submit(task_id, dev, Upload.build(plan, g(plan, 2), 10, 0.5))
    flaky = Flaky({task_id})
    monkeypatch.setattr(rounds_service, "load_master", flaky)
    with pytest.raises(RuntimeError):
        coord.close_round(task_id)
    coord.tick()  # inside the backoff, and still failing: a second failed attempt
    time.sleep(0.06)
    coord.tick()
    failing = coord.task_status(task_id)

    # Act: the cause goes away; the next tick after the backoff finishes the close
    flaky.failing.clear()
    time.sleep(0.25)
    coord.tick()

    # Assert
    assert failing.state == "aggregating" and failing.close_attempts == 2
    assert failing.close_error is not None and "transient model load" in failing.close_error
    status = coord.task_status(task_id)
    assert (status.version, status.state, status.close_error) == (1, "idle", None)
    assert len(coord.rt.close_failures) == 0


def test_recovery_of_one_failing_task_does_not_stop_the_others(
        coord: Coordinator, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: two tasks left aggregating (as by a crash); the first one's close fails again
    tasks = [coord.create_task(spec) for _ in range(2)]
    for t in tasks:
        dev = coord.enroll(t)[0]
        plan = coord.open_round(t)
        coord.submit(t, dev, Upload.build(plan, g(plan, 3), 10, 0.5))
        rounds_service._begin_close(coord.rt, t)
    monkeypatch.setattr(rounds_service, "load_master", Flaky({tasks[0]}))

    # Act
    done = rounds_service.recover(coord.rt)

    # Assert: the second task recovered; the first is recorded for the ticker's retry
    assert [e.task_id for e in done] == [tasks[1]]
    assert coord.task_status(tasks[1]).version == 1
    assert set(coord.rt.close_failures) == {tasks[0]}
    assert coord.task_status(tasks[0]).close_attempts == 1


def test_a_failing_close_shows_on_readyz_and_the_task_status_until_retried(
        sqlite_url: str, tmp_path: Path, spec: TaskSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(sqlite_url, tmp_path / "store", tick_interval_s=0.05,
                             close_retry_base_s=0.05, close_retry_max_s=0.1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        rt: Runtime = client.app.state.runtime  # type: ignore[attr-defined]
        coord = Coordinator(rt)
        task_id = coord.create_task(spec, quorum=5)
        dev = coord.enroll(task_id)[0]
        plan = coord.open_round(task_id)
        coord.submit(task_id, dev, Upload.build(plan, g(plan, 4), 10, 0.5))
        flaky = Flaky({task_id})
        monkeypatch.setattr(rounds_service, "load_master", flaky)
        closing = client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)
        ready = client.get("/readyz")
        status = client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()

        flaky.failing.clear()
        deadline = time.monotonic() + 10
        while coord.task_status(task_id).version == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the app's ticker retries in the running process
        healed = client.get("/readyz").json()

    assert closing.status_code == 500
    assert ready.status_code == 200 and ready.json()["status"] == "degraded"
    (failing,) = ready.json()["failing_closes"]
    assert failing["task_id"] == task_id and failing["round"] == 1
    assert "RuntimeError" in status["close_error"] and status["close_attempts"] >= 1
    assert healed["status"] == "ok"


def test_a_round_left_aggregating_without_a_record_is_finished_by_the_ticker(
        coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: uploads stopped, but the close never ran (nor noted a failure)
    task_id = coord.create_task(spec)
    dev = coord.enroll(task_id)[0]
    plan = coord.open_round(task_id)
    coord.submit(task_id, dev, Upload.build(plan, g(plan, 5), 10, 0.5))
    rounds_service._begin_close(coord.rt, task_id)

    # Act
    coord.tick()

    # Assert
    assert (coord.task_status(task_id).version, coord.task_status(task_id).state) == (1, "idle")
