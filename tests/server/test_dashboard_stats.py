"""The per-device list added to the task stats for the dashboard (`TaskStats.devices`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from seedfed.server.coordinator import Coordinator
from seedfed.server.service.log import device_summaries
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import Upload

from tests.server.conftest import make_settings


def upload(coord: Coordinator, task_id: str, device_id: str, rng: np.random.Generator) -> None:
    plan = coord.current_plan(task_id)
    assert plan is not None
    g = rng.normal(size=(plan.steps, plan.perturbations)).astype(np.float32)
    coord.submit(task_id, device_id, Upload.build(plan, g, num_examples=4, loss=0.7))


@pytest.fixture
def coord(database_url: str, tmp_path: Path) -> Iterator[Coordinator]:
    """On SQLite and PostgreSQL: the listing's NULLS LAST ordering must hold on both."""
    with Coordinator.open(make_settings(database_url, tmp_path / "store")) as c:
        yield c


def test_devices_are_listed_most_recently_seen_first_with_their_uploads(
        coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: 4 devices; a uploads in rounds 1 and 2, b in round 1, c never, d revoked
    rng = np.random.default_rng(0)
    task_id = coord.create_task(spec, quorum=5)
    a, b, c, d = (coord.enroll(task_id)[0] for _ in range(4))
    coord.open_round(task_id)
    upload(coord, task_id, b, rng)
    upload(coord, task_id, a, rng)
    coord.close_round(task_id)
    coord.open_round(task_id)
    upload(coord, task_id, a, rng)
    coord.revoke(task_id, d)

    # Act
    stats = coord.stats(task_id)
    with coord.rt.transaction() as s:
        first_two = device_summaries(s, task_id=task_id, limit=2)

    # Assert
    listed = [(x.device_id, x.uploads, x.last_round, x.revoked_at is not None)
              for x in stats.devices]
    assert listed[:2] == [(a, 2, 2, False), (b, 1, 1, False)]
    assert sorted(listed[2:]) == sorted([(c, 0, None, False), (d, 0, None, True)])
    assert all(x.last_seen_at is None for x in stats.devices[2:])
    assert stats.devices[0].last_seen_at >= stats.devices[1].last_seen_at  # type: ignore[operator]
    assert len(stats.devices) == stats.devices_enrolled == 4
    assert stats.devices_seen == sum(x.uploads > 0 for x in stats.devices) == 2
    assert [x.device_id for x in first_two] == [a, b]
