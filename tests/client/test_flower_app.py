"""The ClientApp against the real strategy and coordinator, messages passed in-process.

No Simulation Engine here (tests/test_simulate.py runs one): each round is configure_train ->
ClientApp -> aggregate_train -> configure_evaluate -> ClientApp -> aggregate_evaluate, exactly
the calls `Strategy.start` makes, so the wire contract and the catch-up logic are exercised
message by message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from seedfed.client.device_data import DeviceData
from seedfed.client.flower_app import STATE, make_client_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.flower_strategy import FleetConfig, RoundRecord, SeedfedStrategy, payload_bytes
from seedfed.server.settings import Settings
from seedfed.shared.protocol.records import NUM_EXAMPLES, RECORD
from seedfed.shared.protocol.task import Hyper, TaskSpec

from tests.fleet_helpers import FakeGrid, deliver

NODES = (11, 22)
STEPS, PERTURBATIONS = 3, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fleet(fleet_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[dict]:
    model, data = fleet_assets
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    coord = Coordinator.open(Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                                      store_dir=tmp_path / "store"))
    spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"), scope="lora",
                    hyper=Hyper(lr=1e-3, eps=1e-2, steps=STEPS, perturbations=PERTURBATIONS,
                                batch_size=8), max_seq_len=16)
    task_id = coord.create_task(spec)
    contexts = {n: Context(run_id=7, node_id=n, state=RecordDict(), run_config={},
                           node_config={"partition-id": i, "num-partitions": len(NODES)})
                for i, n in enumerate(NODES)}
    app = make_client_app(DeviceData(source=str(data), alpha=1.0, seed=3))
    strategy = SeedfedStrategy(coord, task_id, FleetConfig(min_devices=len(NODES)))
    yield {"coord": coord, "task": task_id, "contexts": contexts, "app": app,
           "strategy": strategy, "grid": FakeGrid(NODES),
           "make": lambda **kw: SeedfedStrategy(coord, task_id, FleetConfig(**kw))}
    coord.close()


def _deliver(f: dict, messages: list[Message]) -> list[Message]:
    return deliver(f["app"], f["contexts"], messages)


def _round(f: dict, r: int) -> tuple[RoundRecord, list[Message], list[Message]]:
    s, grid = f["strategy"], f["grid"]
    train = list(s.configure_train(r, None, ConfigRecord(), grid))
    replies = _deliver(f, train)
    s.aggregate_train(r, replies)
    sync = list(s.configure_evaluate(r, None, ConfigRecord(), grid))
    s.aggregate_evaluate(r, _deliver(f, sync))
    return s.history[-1], train, replies


def test_two_rounds_advance_the_version_and_every_device_matches_it(fleet: dict) -> None:
    first, train1, _ = _round(fleet, 1)
    second, train2, replies = _round(fleet, 2)

    status = fleet["coord"].task_status(fleet["task"])
    assert status.version == 2
    assert (first.version, second.version) == (1, 2)
    assert second.participants == len(NODES) and not second.failures
    assert second.device_checksums == {n: status.checksum for n in NODES}
    for n, ctx in fleet["contexts"].items():
        assert ctx.state.config_records[STATE]["checksum"] == status.checksum, n
    # new devices got a snapshot; in round 2 they were already current after the sync phase
    assert all("snapshot" in m.content.config_records[RECORD] for m in train1)
    assert not any("snapshot" in m.content.config_records[RECORD] for m in train2)
    assert second.download_bytes < first.download_bytes / 5


def test_the_reply_holds_scalars_example_count_and_loss_within_budget(fleet: dict) -> None:
    record, _, replies = _round(fleet, 1)

    budget = 4 * STEPS * PERTURBATIONS + 256
    for reply in replies:
        payload = reply.content.config_records[RECORD]
        assert set(payload.keys()) == {"g", NUM_EXAMPLES, "loss"}
        assert list(reply.content.keys()) == [RECORD]
        assert payload_bytes(reply.content) <= budget
    assert record.upload_bytes == sum(payload_bytes(r.content) for r in replies)
    # the coordinator counts the same bytes on the wire as the strategy measured
    assert fleet["coord"].round_metrics(fleet["task"])[0].upload_bytes == record.upload_bytes


def test_a_device_whose_state_diverged_fails_then_resyncs_from_a_snapshot(fleet: dict) -> None:
    _round(fleet, 1)
    bad = NODES[0]
    stored = fleet["contexts"][bad].state.config_records[STATE]
    stored["checksum"] = "f" * 64  # its stored state no longer matches what it claims

    broken, _, _ = _round(fleet, 2)
    healed, train3, _ = _round(fleet, 3)

    assert broken.participants == 1 and len(broken.failures) == 1
    sent = {m.metadata.dst_node_id: m.content.config_records[RECORD] for m in train3}
    assert "snapshot" in sent[bad] and "snapshot" not in sent[NODES[1]]
    assert healed.participants == len(NODES)
    status = fleet["coord"].task_status(fleet["task"])
    assert healed.device_checksums[bad] == status.checksum


def test_a_reply_with_the_wrong_shape_is_not_submitted(fleet: dict) -> None:
    s, grid = fleet["strategy"], fleet["grid"]
    train = list(s.configure_train(1, None, ConfigRecord(), grid))
    replies = _deliver(fleet, train)
    forged = replies[0].content.config_records[RECORD]
    forged["g"] = bytes(forged["g"])[:-4]  # one scalar short: header and body disagree

    s.aggregate_train(1, replies)

    record = s.history[-1]
    assert record.participants == 1
    assert "WireFormatError" in record.failures[0]


def test_payload_is_measured_on_flowers_serialized_objects() -> None:
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    small = RecordDict({RECORD: ConfigRecord({"g": b"\0" * 8})})
    large = RecordDict({RECORD: ConfigRecord({"g": b"\0" * 800})})

    assert payload_bytes(large) - payload_bytes(small) >= 792


def test_a_device_that_sat_out_catches_up_by_replay_when_it_is_sampled(fleet: dict) -> None:
    fleet["strategy"] = fleet["make"](min_devices=len(NODES), devices_per_round=1,
                                      sync_after_round=False, sample_seed=5)
    trained: list[int] = []
    for r in range(1, 12):
        _, train, _ = _round(fleet, r)
        trained.append(train[0].metadata.dst_node_id)
        if trained[-1] in trained[:-2] and trained[-1] != trained[-2]:
            break  # a device that trained before, then sat out, is back
    last = train[0].content.config_records[RECORD]

    assert trained[-1] in trained[:-2] and trained[-1] != trained[-2], trained
    assert "entries" in last and "snapshot" not in last
    record = fleet["strategy"].history[-1]
    assert record.participants == 1 and not record.failures
    assert fleet["coord"].task_status(fleet["task"]).version == len(trained)


def test_below_quorum_the_round_stays_open_and_no_version_is_made(fleet: dict) -> None:
    fleet["strategy"] = fleet["make"](min_devices=len(NODES), quorum=len(NODES) + 1)

    record, _, _ = _round(fleet, 1)

    assert record.participants == len(NODES) and record.version is None
    status = fleet["coord"].task_status(fleet["task"])
    assert (status.version, status.state) == (0, "open")
