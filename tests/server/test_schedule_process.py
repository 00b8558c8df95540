"""A REST fleet runs itself: a `seedfed coordinator` process, `seedfed task create` and three
REST devices (`client/http_device.py`) reach five versions with no further operator command,
and the coordinator opens no round beyond the task's limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from seedfed.client.device_data import DeviceData
from seedfed.client.http_device import DeviceConfig, HttpDevice
from seedfed.shared.protocol.coordinator_client import CoordinatorClient
from typer.testing import CliRunner

from seedfed.cli import app
from tests.deploy.procs import free_port, healthy, stop, wait_for
from tests.fleet_helpers import replay_when_allowed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

ADMIN = "fleet-admin-" + "z" * 20
ROUNDS = 5


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen, str]]:
    """A real `seedfed coordinator` process on a free port (SQLite); its URL, process, log."""
    port = free_port()
    log = tmp_path / "coordinator.log"
    env = {**os.environ, "SEEDFED_ADMIN_TOKEN": ADMIN, "SEEDFED_TICK_INTERVAL_S": "0.2"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "seedfed"), "coordinator", "--db",
             f"sqlite:///{tmp_path / 'c.db'}", "--store", str(tmp_path / "store"),
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url) as http:
            wait_for("the coordinator", lambda: healthy(http), 120,
                     [("coordinator", proc, str(log))])
        yield url, proc, str(log)
    finally:
        stop([proc])


def test_three_rest_devices_reach_five_versions_without_an_operator(
        coordinator: tuple[str, subprocess.Popen, str], fleet_assets: tuple[Path, Path],
        tmp_path: Path) -> None:
    # Arrange: the task, created the way a user does
    url, proc, log = coordinator
    model, data = fleet_assets
    created = CliRunner().invoke(app, [
        "task", "create", "--url", url, "--model", str(model), "--label", "bad", "--label",
        "good", "--set", "steps=2", "--set", "perturbations=2", "--set", "batch_size=8",
        "--set", "lr=0.001", "--set", "eps=0.01", "--set", "quorum=2", "--rounds", str(ROUNDS),
        "--json"],
        env={"SEEDFED_ADMIN_TOKEN": ADMIN})
    assert created.exit_code == 0, created.stderr
    task = json.loads(created.stdout)
    stop_event = threading.Event()
    errors: list[BaseException] = []

    def device(i: int) -> None:
        cfg = DeviceConfig(url=url, task_id=task["task_id"], join_token=task["join_token"],
                           state_dir=tmp_path / f"dev{i}", model=str(model), poll_s=0.1,
                           data=DeviceData(source=str(data), partition_id=i, num_partitions=3,
                                           alpha=1.0))
        try:
            dev = replay_when_allowed(HttpDevice(cfg))
            while not stop_event.is_set():
                dev.run(rounds=1, deadline_s=1.0)
        except BaseException as e:  # reported by the test, not lost in the thread
            errors.append(e)

    threads = [threading.Thread(target=device, args=(i,), daemon=True) for i in range(3)]

    # Act: the devices start; nobody opens or closes a round
    for t in threads:
        t.start()
    with httpx.Client(base_url=url, timeout=120) as http:
        api = CoordinatorClient(http, ADMIN)
        try:
            wait_for(f"version {ROUNDS}", lambda: bool(errors) or
                     api.status(task["task_id"]).version >= ROUNDS, 600,
                     [("coordinator", proc, log)])
        finally:
            stop_event.set()
            for t in threads:
                t.join(timeout=60)
        status = api.status(task["task_id"])
        rounds = api.request("GET", f"/v1/tasks/{task['task_id']}/rounds").json()

    # Assert: five versions from five rounds, the schedule stopped at its limit
    assert not errors, f"{errors!r}\n--- coordinator log\n{Path(log).read_text()[-3000:]}"
    assert (status.version, status.schedule, status.waiting_for) == (ROUNDS, "auto",
                                                                     "round_limit")
    assert [(r["round"], r["state"]) for r in rounds] == [(n, "closed")
                                                        for n in range(1, ROUNDS + 1)]
    assert all(r["participants"] >= 2 for r in rounds)
