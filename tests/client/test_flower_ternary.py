"""The Flower ClientApp on a ternary (TerMeZO) task, messages passed in-process.

As in test_flower_app.py (no Simulation Engine): each round is configure_train -> ClientApp ->
aggregate_train -> configure_evaluate -> ClientApp -> aggregate_evaluate. The strategy sends a
ternary task's devices the published ternary snapshot (new devices, mask epoch starts) or the
log entries (inside an epoch); the devices hold the packed model and keep in their Context what
rebuilds it, which a SuperNode's fresh process per message relies on.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from seedfed.client import flower_app
from seedfed.client.device_data import DeviceData
from seedfed.client.flower_app import STATE, DeviceRuntime, make_client_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.flower_strategy import FleetConfig, RoundRecord, SeedfedStrategy
from seedfed.server.settings import Settings
from seedfed.shared.model.ternary import bitlinear_modules
from seedfed.shared.protocol.records import RECORD

from tests.fleet_helpers import FakeGrid, deliver, ternary_spec

NODES = (11, 22)
EPOCH_ROUNDS = 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fleet(tiny_llama: Path, fleet_assets: tuple[Path, Path], tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    _, data = fleet_assets
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    monkeypatch.setattr(flower_app, "RUNTIME", DeviceRuntime())
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    task_id = coord.create_task(ternary_spec(tiny_llama, EPOCH_ROUNDS))
    contexts = {n: Context(run_id=7, node_id=n, state=RecordDict(), run_config={},
                           node_config={"partition-id": i, "num-partitions": len(NODES)})
                for i, n in enumerate(NODES)}
    yield {"coord": coord, "task": task_id, "contexts": contexts, "grid": FakeGrid(NODES),
           "app": make_client_app(DeviceData(source=str(data), alpha=1.0, seed=3)),
           "strategy": SeedfedStrategy(coord, task_id, FleetConfig(min_devices=len(NODES))),
           "monkeypatch": monkeypatch}
    coord.close()


def _deliver(f: dict, messages: list[Message], fresh_process: bool) -> list[Message]:
    def fresh() -> None:  # a SuperNode starts a new flwr-clientapp process per message
        f["monkeypatch"].setattr(flower_app, "RUNTIME", DeviceRuntime())

    return deliver(f["app"], f["contexts"], messages, fresh if fresh_process else None)


def _round(f: dict, r: int, fresh_process: bool = False,
           ) -> tuple[RoundRecord, list[Message], list[Message]]:
    s, grid = f["strategy"], f["grid"]
    train = list(s.configure_train(r, None, ConfigRecord(), grid))
    s.aggregate_train(r, _deliver(f, train, fresh_process))
    sync = list(s.configure_evaluate(r, None, ConfigRecord(), grid))
    s.aggregate_evaluate(r, _deliver(f, sync, fresh_process))
    return s.history[-1], train, sync


def _how(m: Message) -> str:
    payload = m.content.config_records[RECORD]
    if "snapshot" in payload:
        return f"snapshot-{payload['snapshot-format']}@{payload['snapshot-version']}"
    return "entries" if "entries" in payload else "none"


@pytest.mark.parametrize("fresh_process", [False, True], ids=["cached", "fresh-process"])
def test_devices_follow_the_task_across_mask_epoch_starts(fleet: dict,
                                                          fresh_process: bool) -> None:
    coord, task = fleet["coord"], fleet["task"]
    trained, synced = [], []

    for r in range(1, 5):
        record, train, sync = _round(fleet, r, fresh_process)
        status = coord.task_status(task)
        # Assert (per round): both trained, and both confirmed the coordinator's new version
        assert not record.failures and record.participants == len(NODES)
        assert status.version == record.version == r
        assert record.device_checksums == {n: status.checksum for n in NODES}
        assert record.sync_mismatches == 0 and record.local_accuracy is not None
        for n, ctx in fleet["contexts"].items():
            stored = ctx.state.config_records[STATE]
            assert (stored["version"], stored["checksum"]) == (r, status.checksum), n
            assert stored["ternary-snapshot-version"] == r - r % EPOCH_ROUNDS, n
        trained.append({_how(m) for m in train})
        synced.append({_how(m) for m in sync})

    # new devices load v0's published ternary snapshot; later they are current at each plan
    assert trained == [{"snapshot-ternary@0"}, {"none"}, {"none"}, {"none"}]
    # the log inside a mask epoch, the ternary snapshot at each epoch start (v2, v4)
    assert synced == [{"entries"}, {"snapshot-ternary@2"}, {"entries"}, {"snapshot-ternary@4"}]
    devices = list(flower_app.RUNTIME._devices.values())
    assert len(devices) == 1
    model = devices[0].backend.model.model
    assert all(m.weight is None and m.packed is not None for _, m in bitlinear_modules(model))


def test_a_device_whose_stored_state_diverged_fails_then_takes_the_ternary_snapshot(
        fleet: dict) -> None:
    _round(fleet, 1)
    bad = NODES[0]
    fleet["contexts"][bad].state.config_records[STATE]["checksum"] = "f" * 64
    fleet["monkeypatch"].setattr(flower_app, "RUNTIME", DeviceRuntime())  # restart from Context

    broken, _, _ = _round(fleet, 2)
    healed, train3, _ = _round(fleet, 3)

    assert broken.participants == 1 and len(broken.failures) == 1
    sent = {m.metadata.dst_node_id: _how(m) for m in train3}
    assert sent == {bad: "snapshot-ternary@2", NODES[1]: "none"}
    status = fleet["coord"].task_status(fleet["task"])
    assert healed.participants == len(NODES)
    assert healed.device_checksums == {n: status.checksum for n in NODES}
