"""The plain-HTTP device against the real coordinator app (FastAPI TestClient, SQLite)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import DeviceConfig, DeviceHttpError, HttpDevice
from seedfed.client.personal import PersonalConfig
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import Hyper, TaskSpec

from tests.fleet_helpers import replay_when_allowed

pytestmark = pytest.mark.usefixtures("one_torch_thread")




@pytest.fixture
def world(fleet_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[dict]:
    model, data = fleet_assets
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"),
                    hyper=Hyper(lr=1e-3, eps=1e-2, steps=2, perturbations=2, batch_size=8),
                    max_seq_len=16)
    task_id, join = coord.create_task_with_token(spec, quorum=50)  # closed by hand below
    with TestClient(create_app(runtime=coord.rt)) as client:
        def device(i: int, token: str | None = join,
                   personal: PersonalConfig | None = None) -> HttpDevice:
            cfg = DeviceConfig(url="http://testserver", task_id=task_id, join_token=token,
                               state_dir=tmp_path / f"dev{i}", model=str(model), poll_s=0.05,
                               data=DeviceData(source=str(data), partition_id=i,
                                               num_partitions=2, alpha=1.0),
                               personal=personal)
            return replay_when_allowed(HttpDevice(cfg, client=client))

        yield {"coord": coord, "task": task_id, "device": device}
    coord.close()


def test_two_devices_train_two_rounds_and_match_the_coordinator(world: dict) -> None:
    coord, task = world["coord"], world["task"]
    devices = [world["device"](0), world["device"](1)]
    for d in devices:
        d.enroll()

    plan1 = coord.open_round(task)
    first = [d.train_and_upload(plan1) for d in devices]
    coord.close_round(task)
    plan2 = coord.open_round(task)
    second = [d.train_and_upload(plan2) for d in devices]
    coord.close_round(task)
    synced = [d.sync() for d in devices]

    status = coord.task_status(task)
    assert status.version == 2
    assert [o.sync for o in first] == ["snapshot", "snapshot"]
    assert [o.sync for o in second] == ["replay", "replay"]
    assert {s.checksum for s in synced} == {status.checksum}
    assert all(o.upload_bytes == 16 + 4 * 2 * 2 for o in first + second)
    assert [m.participants for m in coord.round_metrics(task)[:2]] == [2, 2]
    # the aggregation weight is each device's training-set size (FedAvg's n_k), not its batch
    sizes = [len(d.examples()) for d in devices]
    assert [o.num_examples for o in first] == sizes and sizes != [8, 8]


def test_a_personalized_device_reports_its_held_out_accuracies_for_each_round(
        world: dict) -> None:
    # Arrange: one device with a personal part, one without
    coord, task = world["coord"], world["task"]
    personal, plain = world["device"](0, personal=PersonalConfig()), world["device"](1)
    for d in (personal, plain):
        d.enroll()

    # Act
    plan = coord.open_round(task)
    outcomes = [d.train_and_upload(plan) for d in (personal, plain)]
    (row,) = coord.device_metrics(task, plan.round)
    (stats,) = coord.stats(task).rounds

    # Assert: the numbers it scored, stored for the round; nothing from the plain device
    sent = outcomes[0].metrics
    assert sent is not None and outcomes[1].metrics is None
    assert (row.device_id, row.version, row.num_examples) == (
        personal.meta["device_id"], plan.version, len(personal.held_out()))
    assert (row.shared_accuracy, row.personal_accuracy, row.local_accuracy) == (
        sent.shared_accuracy, sent.personal_accuracy, sent.local_accuracy)
    assert row.personal_accuracy is not None and row.local_accuracy is not None
    assert (stats.metric_devices, stats.personal_accuracy_mean) == (1, sent.personal_accuracy)


def test_a_restarted_device_keeps_its_token_and_state(world: dict) -> None:
    coord, task = world["coord"], world["task"]
    d = world["device"](0)
    d.enroll()
    coord.open_round(task)
    d.run(rounds=1)
    coord.close_round(task)
    d.sync()

    again = world["device"](0, token=None)  # no join token: must reuse the stored one
    result = again.sync()

    assert again.enroll() == d.meta["device_id"]
    assert result.method == "none"
    assert result.checksum == coord.task_status(task).checksum


def test_a_wrong_join_token_is_refused_with_the_coordinators_reason(world: dict) -> None:
    d = world["device"](0, token="not-the-token")

    with pytest.raises(DeviceHttpError) as e:
        d.enroll()

    assert 400 <= e.value.status < 500
    assert e.value.detail


def test_a_device_without_a_token_cannot_start(world: dict) -> None:
    d = world["device"](0, token=None)

    with pytest.raises(Exception, match="join token"):
        d.enroll()


def test_a_stored_state_that_does_not_verify_means_a_snapshot_download(world: dict) -> None:
    # Arrange: a device at v1 whose state directory no longer matches its checksum
    coord, task = world["coord"], world["task"]
    d = world["device"](0)
    d.enroll()
    d.train_and_upload(coord.open_round(task))
    coord.close_round(task)
    d.sync()
    d.meta["checksum"] = "f" * 64
    d.store.write_meta()
    # Act: the restarted device cannot trust it
    again = world["device"](0, token=None)
    result = again.sync()
    # Assert
    assert result.method == "snapshot"
    assert result.checksum == coord.task_status(task).checksum == again.meta["checksum"]
