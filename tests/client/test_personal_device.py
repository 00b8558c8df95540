"""A device with a personal part: kept in its state across restarts and catch-up, refused and
rebuilt when it does not fit, and never on the wire (the Flower transport, message by
message, against the real strategy and coordinator)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from seedfed.client.device import Device, MemoryStore
from seedfed.client.device_data import DeviceData, load_device_examples
from seedfed.client.flower_app import STATE, make_client_app
from seedfed.client.personal import PersonalConfig
from seedfed.server.coordinator import Coordinator
from seedfed.server.flower_strategy import FleetConfig, SeedfedStrategy, payload_bytes
from seedfed.server.settings import Settings
from seedfed.shared.protocol.records import LOCAL_ONLY_ACCURACY, METRICS, PERSONAL_ACCURACY, RECORD
from seedfed.shared.protocol.task import Hyper, TaskSpec
from seedfed.shared.protocol.wire import Upload
from torch import Tensor

from tests.fleet_helpers import FakeGrid, deliver

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NODES = (11, 22)


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                  store_dir=tmp_path / "store"))
    yield c
    c.close()


def _spec(model: Path) -> TaskSpec:
    return TaskSpec(model_path=str(model), label_texts=("bad", "good"), max_seq_len=16,
                    scope="named", scope_options={"patterns": ["classifier"]},
                    hyper=Hyper(lr=1e-2, eps=1e-2, steps=2, perturbations=2, batch_size=8))


def _data(fleet_assets: tuple[Path, Path]) -> DeviceData:
    return DeviceData(source=str(fleet_assets[1]), partition_id=0, num_partitions=2, alpha=1.0)


def _round(coord: Coordinator, task_id: str, device: Device, data: DeviceData) -> None:
    plan = coord.open_round(task_id)
    device.sync(plan.version, fetch=lambda: coord.snapshot(task_id, plan.version))
    trained = device.train(plan, load_device_examples(data)[0], data)
    coord.submit(task_id, coord.enroll(task_id)[0],
                 Upload.build(plan, trained.scalars, trained.num_examples, trained.loss))
    coord.close_round(task_id)


def _values(blob: bytes | None) -> list[tuple[str, list[float]]]:
    from safetensors.torch import load

    assert blob is not None
    return sorted((k, v.tolist()) for k, v in load(blob).items())


def _theta(device: Device) -> Tensor:
    assert device.personal is not None and device.personal.personal is not None
    return device.personal.personal.theta


def test_the_personal_part_survives_a_restart_and_a_catch_up(
        coord: Coordinator, fleet_assets: tuple[Path, Path]) -> None:
    # Arrange
    spec = _spec(fleet_assets[0])
    task_id = coord.create_task(spec)
    store, data = MemoryStore(), _data(fleet_assets)
    device = Device(spec, task_id, store, personal=PersonalConfig())
    _round(coord, task_id, device, data)
    assert store.state is not None and store.state.personal is not None
    kept = store.state.personal
    # Act: the shared model moves on by replay, then the device restarts
    device.sync(1, entries=[e.to_entry() for e in coord.log_since(task_id, 0)])
    after_sync = store.state.personal
    restarted = Device(spec, task_id, store, personal=PersonalConfig())
    resumed = restarted.resume()
    # Assert
    assert resumed and restarted.version == 1
    # catch-up keeps the personal part as it was (compared by value: safetensors does not
    # promise one byte order of its metadata)
    assert _values(after_sync) == _values(kept)
    assert bool((_theta(restarted) == _theta(device)).all())


def test_training_the_personal_part_changes_nothing_uploaded(
        coord: Coordinator, fleet_assets: tuple[Path, Path]) -> None:
    # Arrange: one plan, the same data, a device with and one without a personal part
    spec = _spec(fleet_assets[0])
    task_id = coord.create_task(spec)
    data = _data(fleet_assets)
    examples = load_device_examples(data)[0]
    plan = coord.open_round(task_id)
    devices = [Device(spec, task_id, personal=p) for p in (PersonalConfig(), None)]
    for d in devices:
        d.sync(0, fetch=lambda: coord.snapshot(task_id, 0))
    # Act
    with_personal, without = (d.train(plan, examples, data) for d in devices)
    # Assert
    assert (with_personal.scalars == without.scalars).all()
    assert (with_personal.num_examples, with_personal.loss) == (without.num_examples,
                                                                without.loss)
    assert devices[0].checksum == devices[1].checksum  # the shared state is the same too


@pytest.mark.parametrize("case", ["corrupt", "another task"])
def test_a_personal_state_that_does_not_fit_is_rebuilt_and_the_shared_state_kept(
        coord: Coordinator, fleet_assets: tuple[Path, Path], case: str) -> None:
    # Arrange
    spec = _spec(fleet_assets[0])
    task_id = coord.create_task(spec)
    store, data = MemoryStore(), _data(fleet_assets)
    _round(coord, task_id, Device(spec, task_id, store, personal=PersonalConfig()), data)
    assert store.state is not None and store.state.personal is not None
    if case == "corrupt":
        bad = b"\x00garbage" + store.state.personal[9:]
    else:
        other = coord.create_task(spec)
        foreign = MemoryStore()
        _round(coord, other, Device(spec, other, foreign, personal=PersonalConfig()), data)
        assert foreign.state is not None
        bad = foreign.state.personal
    store.state = dataclasses.replace(store.state, personal=bad)
    shared = (store.state.version, store.state.checksum, store.state.state)
    # Act
    device = Device(spec, task_id, store, personal=PersonalConfig())
    resumed = device.resume()
    # Assert
    assert resumed and (device.version, device.checksum) == shared[:2]
    assert device.personal is not None and device.personal.personal is None
    assert device.personal.refused  # said why
    assert store.state.state == shared[2]  # the shared state is intact


def test_reset_personal_forgets_it_in_the_store(
        coord: Coordinator, fleet_assets: tuple[Path, Path]) -> None:
    # Arrange
    spec = _spec(fleet_assets[0])
    task_id = coord.create_task(spec)
    store, data = MemoryStore(), _data(fleet_assets)
    device = Device(spec, task_id, store, personal=PersonalConfig())
    _round(coord, task_id, device, data)
    # Act
    device.reset_personal()
    restarted = Device(spec, task_id, store, personal=PersonalConfig())
    restarted.resume()
    # Assert
    assert restarted.personal is not None and restarted.personal.personal is None
    assert restarted.version == device.version


# -- on the wire: the Flower transport ----------------------------------------------------------
def _fleet_round(coord: Coordinator, task_id: str, personal: PersonalConfig | None,
                 data: Path, rounds: int = 2) -> tuple[list[Message], dict[int, Context],
                                                      SeedfedStrategy]:
    contexts = {n: Context(run_id=7, node_id=n, state=RecordDict(), run_config={},
                           node_config={"partition-id": i, "num-partitions": len(NODES)})
                for i, n in enumerate(NODES)}
    app = make_client_app(DeviceData(source=str(data), alpha=1.0, seed=3), personal)
    strategy = SeedfedStrategy(coord, task_id, FleetConfig(min_devices=len(NODES)))
    grid = FakeGrid(NODES)
    replies: list[Message] = []
    for r in range(1, rounds + 1):
        train = deliver(app, contexts, list(strategy.configure_train(r, None, ConfigRecord(),
                                                                     grid)))
        strategy.aggregate_train(r, train)
        sync = deliver(app, contexts, list(strategy.configure_evaluate(r, None, ConfigRecord(),
                                                                       grid)))
        strategy.aggregate_evaluate(r, sync)
        replies += train + sync
    return replies, contexts, strategy


def test_no_personal_byte_is_on_the_wire_and_uploads_weigh_the_same(
        coord: Coordinator, fleet_assets: tuple[Path, Path]) -> None:
    # Arrange
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    model, data = fleet_assets
    spec = _spec(model)
    personal_task, plain_task = coord.create_task(spec), coord.create_task(spec)
    # Act
    replies, contexts, strategy = _fleet_round(coord, personal_task, PersonalConfig(), data)
    plain_replies, _, plain_strategy = _fleet_round(coord, plain_task, None, data)
    # Assert: every device keeps a personal part, in its Context only
    stored = [bytes(ctx.state.config_records[STATE]["personal"]) for ctx in contexts.values()]
    assert all(len(s) > 100 for s in stored)
    # no reply carries any of it: not the file, not the raw float32 values of any head
    from safetensors.torch import load

    secrets = [t.numpy().tobytes() for s in stored for t in load(s).values()]
    for reply in replies:
        wire = b"".join(bytes(v) for rec in reply.content.config_records.values()
                        for v in rec.values() if isinstance(v, bytes))
        assert not any(s in wire for s in stored)
        assert not any(secret[:64] in wire for secret in secrets)
        assert "personal" not in reply.content.config_records[RECORD]
    # uploads weigh exactly what they weigh without personalization, round by round
    assert [r.upload_bytes for r in strategy.history] == [
        r.upload_bytes for r in plain_strategy.history]
    assert [payload_bytes(m.content) for m in replies[:len(NODES)]] == [
        payload_bytes(m.content) for m in plain_replies[:len(NODES)]]
    # the sync replies carry the three accuracies as numbers, and the strategy keeps them
    metrics = [m.content.metric_records[METRICS] for m in replies if METRICS in
               m.content.metric_records]
    assert metrics and all(PERSONAL_ACCURACY in m and LOCAL_ONLY_ACCURACY in m
                           for m in metrics)
    last = strategy.history[-1].device_accuracy
    assert set(last) == set(NODES)
    assert all(p is not None and loc is not None for _, p, loc in last.values())
    assert all(p is None for _, p, _ in plain_strategy.history[-1].device_accuracy.values())
    # the coordinator stored every device's numbers per round (the strategy's service call)
    for record, row in zip(strategy.history, coord.stats(personal_task).rounds, strict=True):
        scores = record.device_accuracy.values()
        assert (row.round, row.metric_devices, row.personal_devices) == (record.round, 2, 2)
        assert row.shared_accuracy_mean == pytest.approx(sum(a for a, _, _ in scores) / 2)
        assert row.personal_accuracy_worst_decile == min(p for _, p, _ in scores)
    reports = coord.device_metrics(personal_task, strategy.history[-1].round)
    assert {m.version for m in reports} == {strategy.history[-1].version}
    plain_rows = coord.stats(plain_task).rounds
    assert [(r.metric_devices, r.personal_devices) for r in plain_rows] == [(2, 0), (2, 0)]


# -- the REST device's state directory and `seedfed evaluate --device` --------------------------
def test_evaluate_device_scores_a_state_directory_shared_and_personalized(
        coord: Coordinator, fleet_assets: tuple[Path, Path], tmp_path: Path) -> None:
    import json

    from seedfed.client.device_eval import evaluate_device
    from seedfed.client.http_device import PERSONAL_FILE, TASK_FILE, DirectoryStore
    from typer.testing import CliRunner

    from seedfed.cli import app

    # Arrange: a device that trained one round, its state in a directory
    spec = _spec(fleet_assets[0])
    task_id = coord.create_task(spec)
    state_dir = tmp_path / "device"
    store = DirectoryStore(state_dir, task_id)
    device = Device(spec, task_id, store, personal=PersonalConfig())
    _round(coord, task_id, device, _data(fleet_assets))
    (state_dir / TASK_FILE).write_text(json.dumps(spec.to_dict()))
    # Act
    result = evaluate_device(state_dir, fleet_assets[1], limit=60)
    cli = CliRunner().invoke(app, ["evaluate", "--device", str(state_dir), "--data",
                                   str(fleet_assets[1]), "--limit", "60"])
    (state_dir / PERSONAL_FILE).write_bytes(b"not a personal state")
    refused = evaluate_device(state_dir, fleet_assets[1], limit=60)
    # Assert
    assert (state_dir / PERSONAL_FILE).is_file()
    assert result.personal_trained and result.refused is None and result.version == 0
    assert result.scores.examples == 60
    assert cli.exit_code == 0, cli.output
    assert cli.output.strip().splitlines()[-1] == f"accuracy: {result.scores.personal:.4f}"
    assert not refused.personal_trained and "corrupt" in (refused.refused or "")
    assert refused.scores.personal == refused.scores.shared
