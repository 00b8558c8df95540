"""The transport-free device core against the in-process coordinator: what every adapter
(Flower, REST) relies on, tested once here. The adapters' own tests check only their transport
and where they keep the state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from seedfed.client.backends.base import FP32, DeviceStateError, Fetch, StoredState
from seedfed.client.device import Device, MemoryStore
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.server.coordinator import Coordinator
from seedfed.server.settings import Settings
from seedfed.shared.protocol.npzo import LogEntry
from seedfed.shared.protocol.task import Hyper, TaskSpec
from seedfed.shared.protocol.wire import RoundPlan, Upload

from tests.fleet_helpers import ternary_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                  store_dir=tmp_path / "store"))
    yield c
    c.close()


@pytest.fixture
def fp32_task(coord: Coordinator, fleet_assets: tuple[Path, Path]) -> tuple[str, TaskSpec]:
    model, _ = fleet_assets
    spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"), max_seq_len=16,
                    hyper=Hyper(lr=1e-3, eps=1e-2, steps=2, perturbations=2, batch_size=8))
    return coord.create_task(spec), spec


def _data(fleet_assets: tuple[Path, Path]) -> DeviceData:
    return DeviceData(source=str(fleet_assets[1]), partition_id=0, num_partitions=2, alpha=1.0)


def _fetch(coord: Coordinator, task_id: str, version: int, device: Device | None = None,
           ) -> Fetch:
    fmt = None if device is None or device.snapshot_format == FP32 else device.snapshot_format
    return lambda: coord.snapshot(task_id, version, fmt)


def _log(coord: Coordinator, task_id: str, since: int) -> list[LogEntry]:
    return [e.to_entry() for e in coord.log_since(task_id, since)]


def _advance(coord: Coordinator, task_id: str, device: Device, plan: RoundPlan,
             data: DeviceData) -> None:
    """One round of this device alone: train, upload, close."""
    examples = load_device_examples(data)[0]
    device.sync(plan.version, fetch=_fetch(coord, task_id, plan.version, device))
    trained = device.train(plan, examples, data)
    coord.submit(task_id, coord.enroll(task_id)[0],
                 Upload.build(plan, trained.scalars, trained.num_examples, trained.loss))
    coord.close_round(task_id)


def test_a_new_device_takes_a_snapshot_then_replays_and_stores_each_version(
        coord: Coordinator, fp32_task: tuple[str, TaskSpec],
        fleet_assets: tuple[Path, Path]) -> None:
    # Arrange
    task_id, spec = fp32_task
    store = MemoryStore()
    device = Device(spec, task_id, store)
    data = _data(fleet_assets)
    # Act
    first = device.sync(0, fetch=_fetch(coord, task_id, 0))
    _advance(coord, task_id, device, coord.open_round(task_id), data)
    second = device.sync(1, entries=_log(coord, task_id, 0))
    # Assert
    status = coord.task_status(task_id)
    assert (first.method, second.method) == ("snapshot", "replay")
    assert (second.version, second.checksum) == (1, status.checksum)
    assert store.state is not None and (store.state.version, store.state.checksum) == (
        1, status.checksum)


def test_train_weighs_by_the_training_set_and_returns_to_the_version(
        coord: Coordinator, fp32_task: tuple[str, TaskSpec],
        fleet_assets: tuple[Path, Path]) -> None:
    task_id, spec = fp32_task
    device = Device(spec, task_id)
    device.sync(0, fetch=_fetch(coord, task_id, 0))
    data = _data(fleet_assets)
    examples = load_device_examples(data)[0]
    plan = coord.open_round(task_id)

    trained = device.train(plan, examples, data)

    assert trained.scalars.shape == (plan.steps, plan.perturbations)
    assert trained.num_examples == len(examples) != plan.batch_size
    assert (device.version, device.checksum) == (0, coord.task_status(task_id).checksum)


def test_a_stored_state_that_does_not_verify_invalidates_the_device(
        coord: Coordinator, fp32_task: tuple[str, TaskSpec]) -> None:
    # Arrange: a stored state whose checksum is not what its bytes hash to
    task_id, spec = fp32_task
    good = Device(spec, task_id)
    good.sync(0, fetch=_fetch(coord, task_id, 0))
    assert isinstance(good.store, MemoryStore) and good.store.state is not None
    bad = StoredState(task_id, 0, "f" * 64, good.store.state.state)
    device = Device(spec, task_id, MemoryStore(bad))
    # Act
    with pytest.raises(DeviceStateError, match="unusable"):
        device.resume()
    # Assert: nothing trusted, so without a snapshot it refuses; with one it recovers
    assert device.version is None
    with pytest.raises(DeviceStateError, match="no state"):
        device.sync(0)
    assert device.sync(0, fetch=_fetch(coord, task_id, 0)).method == "snapshot"


def test_without_entries_that_reach_the_target_nor_a_snapshot_sync_raises(
        coord: Coordinator, fp32_task: tuple[str, TaskSpec],
        fleet_assets: tuple[Path, Path]) -> None:
    task_id, spec = fp32_task
    device = Device(spec, task_id)
    _advance(coord, task_id, device, coord.open_round(task_id), _data(fleet_assets))

    with pytest.raises(DeviceStateError, match="send a snapshot"):
        device.sync(1)  # no entries sent

    assert device.version is None


def test_a_snapshot_of_another_format_is_refused(coord: Coordinator,
                                                 fp32_task: tuple[str, TaskSpec]) -> None:
    task_id, spec = fp32_task
    device = Device(spec, task_id)
    data, chk = coord.snapshot(task_id, 0)

    with pytest.raises(DeviceStateError, match="fp32"):
        device.load_snapshot(data, 0, chk, fmt="ternary")


def test_a_ternary_device_resumes_from_its_stored_snapshot_and_latents(
        coord: Coordinator, tiny_llama: Path, fleet_assets: tuple[Path, Path]) -> None:
    # Arrange: a ternary device at v1 (inside mask epoch 0), its state in a store
    task_id = coord.create_task(ternary_spec(tiny_llama, epoch_rounds=4))
    spec = ternary_spec(tiny_llama, epoch_rounds=4)
    store = MemoryStore()
    device = Device(spec, task_id, store)
    _advance(coord, task_id, device, coord.open_round(task_id), _data(fleet_assets))
    device.sync(1, entries=_log(coord, task_id, 0))
    assert device.snapshot_format == "ternary"
    # Act: a fresh process on the same store, no download offered
    again = Device(spec, task_id, store)
    resumed = again.resume()
    result = again.sync(1)
    # Assert
    assert resumed and result.method == "none"
    assert (again.version, again.checksum) == (1, coord.task_status(task_id).checksum)
