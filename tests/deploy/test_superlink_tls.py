"""Flower with TLS and SuperNode authentication, end to end on 127.0.0.1: a `flower-superlink`
with a certificate from a private CA (deploy/make_certs.py) and `--enable-supernode-auth`, two
SuperNodes whose public keys were registered with `flwr supernode register`, the coordinator
behind it, two rounds. A SuperNode with an unregistered key is refused, and so is one that
talks plain HTTP to the TLS SuperLink; neither ever joins the federation.
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
from tests.scripts_loader import load_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

REPO = Path(__file__).resolve().parents[2]
ADMIN = "deploy-tls-admin-token-0123456789"
ROUNDS = 2
make_certs = load_script("deploy/make_certs.py", "deploy_make_certs")


def _flwr(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["flwr", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_tls_superlink_admits_registered_supernodes_only(cluster: dict) -> None:
    # Arrange: certificates, node keys, the coordinator and a task
    tmp, start, procs = cluster["tmp"], cluster["start"], cluster["procs"]
    tls = tmp / "tls"
    make_certs.make_ca_and_server(tls, ["127.0.0.1"])
    keys = [make_certs.make_node_key(tls, name) for name in ("node0", "node1", "intruder")]
    model = make_tiny_bert(tmp / "model")
    data = write_sentiment_tsv(tmp / "data.tsv")
    coord_port, link_port = free_port(), free_port()
    url = f"http://127.0.0.1:{coord_port}"
    start("coordinator", ["seedfed", "coordinator", "--db", f"sqlite:///{tmp / 'c.db'}",
                          "--store", str(tmp / "store"), "--admin-token", ADMIN,
                          "--host", "127.0.0.1", "--port", str(coord_port)])
    http = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {ADMIN}"})
    wait_for("the coordinator", lambda: healthy(http), 90, procs)
    task_id, join = create_task(http, str(model), quorum=2)

    start("superlink", ["flower-superlink", "--ssl-ca-certfile", str(tls / "ca.crt"),
                        "--ssl-certfile", str(tls / "server.crt"),
                        "--ssl-keyfile", str(tls / "server.key"), "--enable-supernode-auth",
                        "--host", "127.0.0.1", "--port", str(link_port),
                        "--disable-runtime-dependency-installation"],
          {"SEEDFED_ADMIN_TOKEN": ADMIN, "SEEDFED_JOIN_TOKEN": join,
           "SEEDFED_COORDINATOR_URL": url})
    wait_for("the SuperLink", lambda: port_open(link_port), 60, procs)
    cli_env = {**cluster["env"], "FLWR_HOME": str(flwr_home(tmp / "cli-home", link_port,
                                                            tls / "ca.crt"))}
    for i in range(2):
        registered = _flwr(["supernode", "register", str(keys[i][1]), "local"], cli_env, tmp)
        assert registered.returncode == 0, registered.stdout + registered.stderr

    def supernode(name: str, i: int, *auth: str) -> subprocess.Popen:
        return start(name, ["flower-supernode", *auth, "--superlink", f"127.0.0.1:{link_port}",
                            "--port", str(free_port()), "--max-retries", "3",
                            "--node-config",
                            f'data="{data}" partition-id={i} num-partitions=2 alpha=1.0'])

    for i in range(2):
        supernode(f"supernode{i}", i, "--root-certificates", str(tls / "ca.crt"),
                  "--auth-supernode-private-key", str(keys[i][0]))
    # the two that must be refused are not watched by wait_for: they are expected to exit
    intruder = supernode("intruder", 0, "--root-certificates", str(tls / "ca.crt"),
                         "--auth-supernode-private-key", str(keys[2][0]))
    plain = supernode("plain", 1, "--insecure")
    watched = [p for p in procs if p[0] not in ("intruder", "plain")]

    # Act: two rounds of the app through the TLS SuperLink
    app_dir = tmp / "app"
    shutil.copytree(REPO / "deploy" / "flower", app_dir)
    report = tmp / "report.json"
    run_config = (f'task-id="{task_id}" num-rounds={ROUNDS} min-devices=2 '
                  f'round-timeout=120.0 report="{report}"')
    submitted = _flwr(["run", str(app_dir), "local", "--run-config", run_config], cli_env, tmp)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    wait_for("two rounds and the report", report.is_file, 300, watched)
    listed = _flwr(["supernode", "list", "local", "--format", "json"], cli_env, tmp)

    # Assert: two rounds by the two registered nodes, the others refused
    status = http.get(f"/v1/tasks/{task_id}").json()
    records = json.loads(report.read_text())
    assert status["version"] == ROUNDS
    assert all(r["participants"] == 2 and not r["failures"] for r in records)
    assert set(records[-1]["device_checksums"].values()) == {status["checksum"]}
    assert listed.returncode == 0, listed.stdout + listed.stderr
    nodes = json.loads(listed.stdout)["nodes"]
    assert len(nodes) == 2, listed.stdout
    for name, proc in (("intruder", intruder), ("plain", plain)):
        rc = proc.wait(timeout=120)
        log = (tmp / f"{name}.log").read_text()
        assert rc != 0, f"{name} was not refused:\n{log[-2000:]}"
        assert "Failed to initialize the connection to the SuperLink" in log, log[-2000:]
    # the unregistered key reached the SuperLink and was turned away by name
    assert "Attempted to register SuperNode with public key" in (tmp / "superlink.log").read_text()
