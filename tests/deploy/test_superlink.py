"""End to end on real Flower deployment processes: a `seedfed coordinator`, a
`flower-superlink` and two `flower-supernode`s on 127.0.0.1 (insecure HTTP), the app in
deploy/flower submitted with `flwr run`. Two rounds later the coordinator's version has
advanced twice and both devices report the coordinator's checksum.

Every process runs in its own process group and is killed in teardown; every wait is bounded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.deploy.procs import create_task, flwr_home, free_port, healthy, port_open, wait_for
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
ADMIN = "deploy-test-admin-token-0123456789"
ROUNDS = 2


def test_two_rounds_on_superlink_and_two_supernodes(cluster: dict) -> None:
    tmp, start, procs = cluster["tmp"], cluster["start"], cluster["procs"]
    model = make_tiny_bert(tmp / "model")
    data = write_sentiment_tsv(tmp / "data.tsv")
    coord_port, link_port = free_port(), free_port()
    url = f"http://127.0.0.1:{coord_port}"

    # the coordinator, and a task for the fleet (quorum: both devices)
    start("coordinator", ["seedfed", "coordinator", "--db", f"sqlite:///{tmp / 'c.db'}",
                          "--store", str(tmp / "store"), "--admin-token", ADMIN,
                          "--host", "127.0.0.1", "--port", str(coord_port)])
    http = httpx.Client(base_url=url, timeout=30,
                        headers={"Authorization": f"Bearer {ADMIN}"})
    wait_for("the coordinator", lambda: healthy(http), 90, procs)
    task_id, join = create_task(http, str(model), quorum=2)

    # the SuperLink (its ServerApp reaches the coordinator over REST) and two SuperNodes
    start("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port",
                        str(link_port), "--disable-runtime-dependency-installation"],
          {"SEEDFED_ADMIN_TOKEN": ADMIN, "SEEDFED_JOIN_TOKEN": join,
           "SEEDFED_COORDINATOR_URL": url})
    wait_for("the SuperLink", lambda: port_open(link_port), 60, procs)
    for i in range(2):
        start(f"supernode{i}", [
            "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link_port}",
            "--port", str(free_port()),
            "--node-config", f'data="{data}" partition-id={i} num-partitions=2 alpha=1.0'])

    # submit the app; the CLI gets a Flower home of its own (the SuperNodes write theirs)
    home = flwr_home(tmp / "cli-home", link_port)
    app_dir = tmp / "app"
    shutil.copytree(REPO / "deploy" / "flower", app_dir)
    report = tmp / "report.json"
    run_config = (f'task-id="{task_id}" num-rounds={ROUNDS} min-devices=2 '
                  f'round-timeout=120.0 report="{report}"')
    cli_env = {**cluster["env"], "FLWR_HOME": str(home)}
    submitted = subprocess.run(["flwr", "run", str(app_dir), "local", "--run-config",
                                run_config], cwd=tmp, env=cli_env, capture_output=True,
                               text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr

    wait_for("two rounds and the report", report.is_file, 300, procs)

    status = http.get(f"/v1/tasks/{task_id}").json()
    records = json.loads(report.read_text())
    assert status["version"] == ROUNDS
    assert [r["version"] for r in records] == list(range(1, ROUNDS + 1))
    assert all(r["participants"] == 2 and not r["failures"] for r in records)
    final = records[-1]["device_checksums"]
    assert len(final) == 2
    assert set(final.values()) == {status["checksum"]}
    budget = 4 * 2 * 2 + 256
    assert all(r["upload_bytes"] <= 2 * budget for r in records)
