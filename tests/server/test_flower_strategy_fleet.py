"""The ServerApp strategy (server/flower_strategy.py) with fleets larger than a round: the sync
phase reaches the round's devices only, and a round whose every device failed stops a fleet
that asked for it (a simulation) with the first failure."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from seedfed.client.device_data import DeviceData
from seedfed.client.flower_app import make_client_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.flower_strategy import FleetConfig, FleetFailedError, SeedfedStrategy
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import Hyper, TaskSpec

from tests.fleet_helpers import FakeGrid, deliver

NODES = tuple(range(101, 131))  # 30 devices
PER_ROUND = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fleet(fleet_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[dict]:
    model, data = fleet_assets
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"), scope="named",
                    scope_options={"patterns": ["classifier"]}, max_seq_len=16,
                    hyper=Hyper(lr=1e-2, eps=1e-2, steps=1, perturbations=2, batch_size=4))
    task_id = coord.create_task(spec)
    contexts = {n: Context(run_id=7, node_id=n, state=RecordDict(), run_config={},
                           node_config={"partition-id": i, "num-partitions": len(NODES)})
                for i, n in enumerate(NODES)}
    app = make_client_app(DeviceData(source=str(data), alpha=1.0, seed=3))
    yield {"coord": coord, "task": task_id, "contexts": contexts, "app": app,
           "grid": FakeGrid(NODES),
           "make": lambda **kw: SeedfedStrategy(coord, task_id, FleetConfig(**kw))}
    coord.close()


def test_the_sync_phase_reaches_only_the_devices_that_trained_this_round(fleet: dict) -> None:
    # Arrange
    s = fleet["make"](devices_per_round=PER_ROUND, min_devices=len(NODES))
    trained, synced = [], []
    # Act: three rounds of 4 of 30 devices, each followed by its sync phase
    for r in (1, 2, 3):
        train = list(s.configure_train(r, None, ConfigRecord(), fleet["grid"]))
        s.aggregate_train(r, deliver(fleet["app"], fleet["contexts"], train))
        sync = list(s.configure_evaluate(r, None, ConfigRecord(), fleet["grid"]))
        s.aggregate_evaluate(r, deliver(fleet["app"], fleet["contexts"], sync))
        trained.append(sorted(m.metadata.dst_node_id for m in train))
        synced.append(sorted(m.metadata.dst_node_id for m in sync))
    # Assert: never the devices of earlier rounds (a cost of the round, not the fleet)
    assert synced == trained
    assert all(len(t) == PER_ROUND for t in trained)
    assert len({n for t in trained for n in t}) > PER_ROUND  # other devices each round
    assert [rec.synced for rec in s.history] == [PER_ROUND] * 3


def _errors(messages: list[Message]) -> list[Message]:
    return [Message(Error(code=0, reason=f"ValueError: bad data on node {m.metadata.dst_node_id}"),
                    reply_to=m) for m in messages]


def test_a_round_whose_every_device_failed_stops_with_the_first_failure(fleet: dict) -> None:
    # Arrange
    s = fleet["make"](devices_per_round=PER_ROUND, stop_when_all_fail=True)
    train = list(s.configure_train(1, None, ConfigRecord(), fleet["grid"]))
    first = train[0].metadata.dst_node_id
    # Act / Assert
    with pytest.raises(FleetFailedError, match=f"all {PER_ROUND} sampled devices failed; the "
                       f"first: device {first}: ValueError: bad data on node {first}"):
        s.aggregate_train(1, _errors(train))
    assert fleet["coord"].task_status(fleet["task"]).version == 0


def test_devices_that_do_not_reply_count_as_failed(fleet: dict) -> None:
    s = fleet["make"](devices_per_round=PER_ROUND, stop_when_all_fail=True)
    list(s.configure_train(1, None, ConfigRecord(), fleet["grid"]))

    with pytest.raises(FleetFailedError, match=f"{PER_ROUND} of {PER_ROUND} devices did not "
                       "reply within the round timeout"):
        s.aggregate_train(1, [])


def test_a_deployed_fleet_keeps_going_and_one_good_device_is_enough(fleet: dict) -> None:
    # Arrange: the default (a deployment) does not stop; with stopping asked for, one device
    # that trains keeps the round
    keep_going = fleet["make"](devices_per_round=PER_ROUND)
    train = list(keep_going.configure_train(1, None, ConfigRecord(), fleet["grid"]))
    keep_going.aggregate_train(1, _errors(train))
    stopping = fleet["make"](devices_per_round=PER_ROUND, stop_when_all_fail=True)
    train = list(stopping.configure_train(2, None, ConfigRecord(), fleet["grid"]))
    replies = deliver(fleet["app"], fleet["contexts"], train[:1]) + _errors(train[1:])
    # Act
    stopping.aggregate_train(2, replies)
    # Assert
    assert keep_going.history[-1].participants == 0
    assert len(keep_going.history[-1].failures) == PER_ROUND
    assert stopping.history[-1].participants == 1 and stopping.history[-1].version == 1
