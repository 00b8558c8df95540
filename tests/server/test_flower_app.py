"""The deployment ServerApp's two ways to reach the coordinator, driven through
`Strategy.start` with an in-process grid that hands each message to the real ClientApp.

tests/deploy/test_superlink.py runs the same code on real SuperLink/SuperNode processes; here
the grid is a stand-in so the REST adapter and the run-config handling are checked quickly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from flwr.app import ArrayRecord, Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from seedfed.client.device_data import DeviceData
from seedfed.client.flower_app import make_client_app
from seedfed.server.app import create_app
from seedfed.server.coordinator import Coordinator
from seedfed.server.flower_app import RestCoordinator, run_fleet
from seedfed.server.flower_strategy import FleetConfig, SeedfedStrategy
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import Hyper, TaskSpec

ADMIN = "server-app-test-admin-token"
NODES = (5, 6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class LocalGrid:
    """A Grid whose nodes run the ClientApp in this process (what a SuperLink does remotely)."""

    def __init__(self, data: Path) -> None:
        self.app = make_client_app(DeviceData(source=str(data), alpha=1.0))
        self.contexts = {n: Context(run_id=9, node_id=n, state=RecordDict(), run_config={},
                                    node_config={"partition-id": i, "num-partitions": 2})
                         for i, n in enumerate(NODES)}

    def get_node_ids(self) -> list[int]:
        return list(NODES)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None,
                         ) -> list[Message]:
        replies = []
        for m in messages:
            try:
                replies.append(self.app(m, self.contexts[m.metadata.dst_node_id]))
            except Exception as e:  # noqa: BLE001 - as Flower's runtime reports it
                replies.append(Message(Error(code=0, reason=str(e)), reply_to=m))
        return replies




@pytest.fixture
def task(fleet_assets: tuple[Path, Path], tmp_path: Path) -> Iterator[dict]:
    model, data = fleet_assets
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 9, 0
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'c.db'}",
                        store_dir=tmp_path / "store", admin_token=ADMIN)
    coord = Coordinator.open(settings)
    spec = TaskSpec(model_path=str(model), label_texts=("bad", "good"), max_seq_len=16,
                    hyper=Hyper(lr=1e-3, eps=1e-2, steps=2, perturbations=2, batch_size=8))
    task_id, join = coord.create_task_with_token(spec, quorum=2)
    yield {"coord": coord, "task": task_id, "join": join, "grid": LocalGrid(data),
           "settings": settings, "tmp": tmp_path}
    coord.close()


def test_strategy_over_rest_trains_and_every_device_matches(task: dict) -> None:
    coord = task["coord"]
    with TestClient(create_app(runtime=coord.rt)) as client:
        rest = RestCoordinator("http://testserver", ADMIN, task["join"], client=client)
        strategy = SeedfedStrategy(rest, task["task"], FleetConfig(min_devices=2, quorum=2))

        strategy.start(task["grid"], ArrayRecord(), num_rounds=2, timeout=60)

    status = coord.task_status(task["task"])
    assert status.version == 2
    assert [r.version for r in strategy.history] == [1, 2]
    assert set(strategy.history[-1].device_checksums.values()) == {status.checksum}
    assert [m.participants for m in coord.round_metrics(task["task"])] == [2, 2]
    # each synced device's held-out accuracy went to the coordinator as that device, over REST
    stored = coord.round_metrics(task["task"])
    assert [m.metric_devices for m in stored] == [2, 2]
    assert [m.shared_accuracy_mean for m in stored] == pytest.approx(
        [sum(a for a, _, _ in r.device_accuracy.values()) / 2 for r in strategy.history])


def test_a_task_created_over_rest_is_never_raced_by_its_schedule_while_the_strategy_drives_it(
        task: dict) -> None:
    # Arrange: a task created over REST keeps the default automatic schedule, and a REST
    # device enrolled before the ServerApp started, so the schedule opened round 1 itself
    tmp, spec = task["tmp"], task["coord"].task_spec(task["task"])
    settings = Settings(database_url=f"sqlite:///{tmp / 'rest.db'}", store_dir=tmp / "rest",
                        admin_token=ADMIN, tick_interval_s=0.02)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with TestClient(create_app(settings)) as client:
        created = client.post("/v1/tasks", headers=auth,
                              json={"spec": spec.to_dict(), "quorum": 2}).json()
        task_id, join = created["task_id"], created["join_token"]
        client.post(f"/v1/tasks/{task_id}/devices", json={"join_token": join})
        deadline = time.monotonic() + 20
        while client.get(f"/v1/tasks/{task_id}/rounds/current", headers=auth).status_code != 200:
            assert time.monotonic() < deadline, "the schedule opened no round"
            time.sleep(0.02)
        rest = RestCoordinator("http://testserver", ADMIN, join, client=client)
        strategy = SeedfedStrategy(rest, task_id, FleetConfig(min_devices=2, quorum=2))

        # Act: the strategy drives two rounds, then the coordinator ticks on
        strategy.start(task["grid"], ArrayRecord(), num_rounds=2, timeout=60)
        time.sleep(0.2)
        rounds = client.get(f"/v1/tasks/{task_id}/rounds", headers=auth).json()
        status = client.get(f"/v1/tasks/{task_id}", headers=auth).json()

    # Assert: the strategy's two rounds and no other; the task is the strategy's now
    assert [r.round for r in strategy.history] == [1, 2]
    assert [(r["round"], r["state"]) for r in rounds] == [(1, "closed"), (2, "closed")]
    assert (status["version"], status["schedule"], status["state"]) == (2, "manual", "idle")


@pytest.mark.parametrize("transport", ["in-process", "rest"])
def test_a_refused_upload_fails_its_device_alone(task: dict, transport: str) -> None:
    coord = task["coord"]
    with TestClient(create_app(runtime=coord.rt)) as client:
        port = coord if transport == "in-process" else RestCoordinator(
            "http://testserver", ADMIN, task["join"], client=client)
        strategy = SeedfedStrategy(port, task["task"], FleetConfig(min_devices=2, quorum=1))
        strategy.start(task["grid"], ArrayRecord(), num_rounds=1, timeout=60)
        coord.revoke(task["task"], strategy._nodes[NODES[0]].device_id)

        strategy.start(task["grid"], ArrayRecord(), num_rounds=1, timeout=60)

    last = strategy.history[-1]
    assert (last.participants, last.version) == (1, 2)
    assert len(last.failures) == 1 and f"device {NODES[0]}" in last.failures[0]
    assert "revoked" in last.failures[0], last.failures


def test_rest_adapter_reports_the_coordinators_refusal(task: dict) -> None:
    with TestClient(create_app(runtime=task["coord"].rt)) as client:
        rest = RestCoordinator("http://testserver", "wrong-admin-token", task["join"],
                               client=client)

        with pytest.raises(Exception, match="401|403"):
            rest.open_round(task["task"])


def test_run_fleet_in_process_writes_its_report(task: dict) -> None:
    task["coord"].close()  # the ServerApp owns the database for its run
    report = task["tmp"] / "report.json"
    cfg = {"db-url": task["settings"].database_url, "store-dir": str(task["tmp"] / "store"),
           "task-id": task["task"], "num-rounds": 2, "min-devices": 2, "sync": True,
           "report": str(report)}

    records = run_fleet(task["grid"], cfg)

    assert json.loads(report.read_text()) == json.loads(json.dumps(records, default=str))
    assert [r["version"] for r in records] == [1, 2]
    again = Coordinator.open(task["settings"])
    try:
        assert again.task_status(task["task"]).version == 2
    finally:
        task["coord"] = again  # closed by the fixture


def test_run_fleet_needs_a_way_to_the_coordinator(task: dict) -> None:
    with pytest.raises(Exception, match="coordinator-url"):
        run_fleet(task["grid"], {"task-id": task["task"]})


def test_sync_every_skips_the_sync_phase_between_and_ends_on_the_same_state(
        task: dict) -> None:
    # Rounds 1 and 3 of 4 skip the sync phase: the devices replay the entry they missed with
    # their next plan instead, so the fleet trains the same versions and ends in sync.
    strategy = SeedfedStrategy(task["coord"], task["task"],
                               FleetConfig(min_devices=2, quorum=2, sync_every=2, final_round=4))

    strategy.start(task["grid"], ArrayRecord(), num_rounds=4, timeout=60)

    status = task["coord"].task_status(task["task"])
    assert [r.synced for r in strategy.history] == [0, 2, 0, 2]
    assert [r.version for r in strategy.history] == [1, 2, 3, 4]
    assert set(strategy.history[-1].device_checksums.values()) == {status.checksum}


def test_fleet_config_refuses_a_sync_interval_below_one() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        FleetConfig(sync_every=0)
