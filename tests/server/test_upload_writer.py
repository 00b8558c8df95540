"""The group-commit writer on SQLite and PostgreSQL: one row the database refuses fails only
its own upload, never the honest uploads committed in the same batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from seedfed.server.coordinator import Coordinator
from seedfed.server.schemas import UploadReceipt
from seedfed.server.service.uploads import PendingUpload, UploadWriter, check_upload
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import Upload

from tests.server.conftest import make_settings


@pytest.fixture
def coord(database_url: str, tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator.open(make_settings(database_url, tmp_path / "store"))
    yield c
    c.close()


def test_a_row_the_database_refuses_fails_alone(coord: Coordinator, spec: TaskSpec) -> None:
    # Arrange: five honest uploads and, in the same batch, one whose count no integer column
    # holds (validation refuses it today; the writer must not depend on that alone)
    task_id = coord.create_task(spec, quorum=10)
    devices = [coord.enroll(task_id)[0] for _ in range(6)]
    plan = coord.open_round(task_id)
    pending = []
    for i, dev in enumerate(devices):
        up = Upload.build(plan, np.full((plan.steps, plan.perturbations), i), 5, 0.5)
        p = check_upload(coord.rt, task_id=task_id, round_number=plan.round, device_id=dev,
                         upload=up, wire_bytes=100)
        assert isinstance(p, PendingUpload)
        pending.append(replace(p, num_examples=2**63) if i == 2 else p)
    writer = UploadWriter(coord.rt)
    futures = [writer.submit(p) for p in pending]  # queued before the thread starts: one batch

    # Act
    writer.start()
    outcomes = [f.exception(timeout=30) or f.result() for f in futures]
    writer.stop()

    # Assert
    assert isinstance(outcomes[2], Exception)
    assert all(isinstance(o, UploadReceipt) for i, o in enumerate(outcomes) if i != 2)
    assert coord.rt.rounds.count(pending[0].round_id) == 5
