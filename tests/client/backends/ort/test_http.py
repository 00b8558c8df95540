"""A REST device on the ORT backend and one on the torch backend in one task against the real
coordinator app."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import DeviceConfig, HttpDevice
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings

from tests.client.backends.ort.conftest import head_spec
from tests.fleet_helpers import replay_when_allowed

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_an_ort_device_trains_beside_a_torch_device_and_ends_on_the_coordinators_checksum(
        ort_assets: dict[str, Path], tmp_path: Path) -> None:
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    task, join = coord.create_task_with_token(head_spec(ort_assets["model"]), quorum=50)

    def data(i: int) -> DeviceData:
        return DeviceData(source=str(ort_assets["data"]), partition_id=i, num_partitions=2)

    with TestClient(create_app(runtime=coord.rt)) as client:
        ort_dev = replay_when_allowed(HttpDevice(DeviceConfig(
            url="http://testserver", task_id=task, join_token=join, state_dir=tmp_path / "o",
            backend="ort", model=str(ort_assets["bundle"]), data=data(0), threads=1),
            client=client))
        torch_dev = replay_when_allowed(HttpDevice(DeviceConfig(
            url="http://testserver", task_id=task, join_token=join, state_dir=tmp_path / "t",
            model=str(ort_assets["model"]), data=data(1)), client=client))
        ort_dev.enroll()
        torch_dev.enroll()
        outcomes = []
        for _ in range(2):
            plan = coord.open_round(task)
            outcomes.append([d.train_and_upload(plan) for d in (ort_dev, torch_dev)])
            coord.close_round(task)
        synced = ort_dev.sync()
        restarted = replay_when_allowed(  # state from its directory
            HttpDevice(ort_dev.config, client=client))
        again = restarted.sync()
    status = coord.task_status(task)
    coord.close()

    assert status.version == 2
    assert [o.sync for o in outcomes[0]] == ["snapshot", "snapshot"]
    assert [o.sync for o in outcomes[1]] == ["replay", "replay"]
    assert all(o.upload_bytes == 16 + 4 * 3 * 4 for row in outcomes for o in row)
    assert synced.method == "replay" and synced.checksum == status.checksum
    assert again.method == "none" and again.checksum == status.checksum
