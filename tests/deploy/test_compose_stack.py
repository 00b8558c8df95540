"""deploy/compose.yaml in real containers (run by deploy/check.sh, `make deploy-check`).

The stack (PostgreSQL, the coordinator in production mode, a SuperLink with TLS and SuperNode
authentication) comes up from the images deploy/check.sh built; two SuperNode containers with
registered keys train two rounds; the devices' checksums equal the coordinator's; the
coordinator container restarts without losing its log, version or model files; the log
replayed on this host from snapshot 0 gives the coordinator's checksum (the restore path of
docs/deploy.md). Host networking, 127.0.0.1 only. Skipped unless SEEDFED_DEPLOY_CHECK=1: it
needs the dockerd and images that deploy/check.sh provides.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.procs import create_task, flwr_home, free_port, healthy, port_open
from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv
from tests.scripts_loader import load_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(os.environ.get("SEEDFED_DEPLOY_CHECK") != "1",
                       reason="needs deploy/check.sh (dockerd and the built images)"),
]

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose.yaml"
ROUNDS = 2
IMAGE_UID = 10001  # the image's non-root user: it must read the mounted keys
WARM_IMPORTS = "import torch, transformers, flwr.clientapp, seedfed.client.flower_app"
make_certs = load_script("deploy/make_certs.py", "deploy_make_certs")


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300,
         check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def _until(what: str, ok, timeout: float, logs) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs()}")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict]:
    work = Path(os.environ.get("SEEDFED_DEPLOY_WORK", tmp_path))
    work.mkdir(parents=True, exist_ok=True)
    tls, models, devdata = work / "tls", work / "models", work / "devdata"
    make_certs.make_ca_and_server(tls, ["127.0.0.1"])
    for i in range(2):
        make_certs.make_node_key(tls, f"node{i}")
    make_tiny_bert(models / "tiny")
    devdata.mkdir()
    write_sentiment_tsv(devdata / "data.tsv")
    for p in tls.iterdir():  # 0600 keys: readable by the containers' user, nobody else
        os.chown(p, IMAGE_UID, IMAGE_UID)
    for p in [*models.rglob("*"), *devdata.rglob("*")]:  # safetensors writes 0600 files
        p.chmod(0o755 if p.is_dir() else 0o644)
    ports = {"pg": free_port(), "coord": free_port(), "link": free_port()}
    admin = uuid.uuid4().hex + uuid.uuid4().hex
    env_file = work / "seedfed.env"
    env_file.write_text("\n".join([
        f"POSTGRES_PASSWORD={uuid.uuid4().hex}", f"SEEDFED_ADMIN_TOKEN={admin}",
        "POSTGRES_HOST=127.0.0.1", f"POSTGRES_PORT={ports['pg']}",
        "SEEDFED_HOST=127.0.0.1", f"SEEDFED_PORT={ports['coord']}",
        "SEEDFED_LINK_HOST=127.0.0.1", f"SEEDFED_LINK_PORT={ports['link']}",
        f"SEEDFED_IMAGE={os.environ.get('SEEDFED_IMAGE', 'seedfed-coordinator')}",
        f"SEEDFED_POSTGRES_IMAGE={os.environ.get('SEEDFED_POSTGRES_IMAGE', 'postgres:16')}",
        f"SEEDFED_MODELS={models}", f"SEEDFED_TLS_DIR={tls}", f"SEEDFED_ENV_FILE={env_file}",
    ]) + "\n")
    project = f"seedfedci{uuid.uuid4().hex[:8]}"
    compose = ["docker-compose", "-p", project, "--env-file", str(env_file), "-f", str(COMPOSE)]
    nodes: list[str] = []

    def logs() -> str:
        out = _run([*compose, "logs", "--no-color", "--tail", "60"], check=False)
        node_logs = [_run(["docker", "logs", "--tail", "30", n], check=False) for n in nodes]
        return out.stdout + "".join(f"--- {n}\n{r.stdout}{r.stderr}"
                                    for n, r in zip(nodes, node_logs, strict=True))

    try:
        yield {"work": work, "compose": compose, "ports": ports, "admin": admin, "tls": tls,
               "nodes": nodes, "logs": logs, "project": project}
    finally:
        for n in nodes:
            _run(["docker", "rm", "-f", n], check=False)
        _run([*compose, "down", "-v", "--remove-orphans", "-t", "20"], check=False)


def _container(stack: dict, service: str) -> str:
    return _run([*stack["compose"], "ps", "-q", service]).stdout.strip()


def _health(container: str) -> str:
    out = _run(["docker", "inspect", "-f", "{{.State.Health.Status}}", container], check=False)
    return out.stdout.strip()


def test_compose_stack_two_rounds_restart_and_replay(stack: dict) -> None:
    # Arrange: the stack, a task, two registered SuperNode containers
    compose, ports, logs = stack["compose"], stack["ports"], stack["logs"]
    up = time.monotonic()
    started = _run([*compose, "up", "-d"], timeout=600, check=False)
    assert started.returncode == 0, started.stdout + started.stderr + logs()
    url = f"http://127.0.0.1:{ports['coord']}"
    # generous: creating a task loads the model in the container, on a loaded shared machine
    http = httpx.Client(base_url=url, timeout=180,
                        headers={"Authorization": f"Bearer {stack['admin']}"})
    _until("the coordinator", lambda: healthy(http), 240, logs)
    coordinator = _container(stack, "coordinator")
    _until("the coordinator's healthcheck", lambda: _health(coordinator) == "healthy", 120, logs)
    _until("the SuperLink", lambda: port_open(ports["link"]), 120, logs)
    print(f"stack up in {time.monotonic() - up:.0f} s")
    uid = _run(["docker", "exec", coordinator, "id", "-u"]).stdout.strip()
    task_id, join = create_task(http, "/models/tiny", quorum=2)

    work, tls = stack["work"], stack["tls"]
    cli_env = {**os.environ, "FLWR_HOME": str(flwr_home(work / "cli-home", ports["link"],
                                                        tls / "ca.crt"))}
    for i in range(2):
        _run(["flwr", "supernode", "register", str(tls / f"node{i}.pub"), "local"], cli_env)
    image = os.environ.get("SEEDFED_IMAGE", "seedfed-coordinator")
    for i in range(2):
        name = f"{stack['project']}-node{i}"
        stack["nodes"].append(name)
        _run(["docker", "run", "-d", "--name", name, "--network", "host", "--no-healthcheck",
              "-v", f"{tls}:/tls:ro", "-v", f"{work / 'models'}:/models:ro",
              "-v", f"{work / 'devdata'}:/devdata:ro", "--entrypoint", "sh", image, "-c",
              # Import the ClientApp's modules once first: Flower gives a started app process
              # 30 s to check in, which a cold start on a loaded machine can miss.
              f'python -c "{WARM_IMPORTS}"; exec flower-supernode "$@"', "flower-supernode",
              "--root-certificates", "/tls/ca.crt",
              "--auth-supernode-private-key", f"/tls/node{i}.key",
              "--superlink", f"127.0.0.1:{ports['link']}", "--port", str(free_port()),
              "--node-config",
              f'data="/devdata/data.tsv" partition-id={i} num-partitions=2 alpha=1.0'])

    # Act 1: two rounds through the SuperLink container
    app_dir = work / "app"
    shutil.copytree(REPO / "deploy" / "flower", app_dir)
    report = "/data/report.json"  # inside the SuperLink container (its volume)
    run_config = (f'task-id="{task_id}" join-token="{join}" num-rounds={ROUNDS} '
                  f'min-devices=2 round-timeout=180.0 report="{report}"')
    _run(["flwr", "run", str(app_dir), "local", "--run-config", run_config], cli_env)
    superlink = _container(stack, "superlink")

    def reported() -> bool:
        return _run(["docker", "exec", superlink, "test", "-s", report], check=False
                    ).returncode == 0

    _until("two rounds and the report", reported, 600, logs)
    records = json.loads(_run(["docker", "exec", superlink, "cat", report]).stdout)
    before = http.get(f"/v1/tasks/{task_id}").json()
    log_before = http.get(f"/v1/tasks/{task_id}/log").json()
    snap_before = http.get(f"/v1/tasks/{task_id}/snapshots/{ROUNDS}")

    # Act 2: restart the coordinator container
    _run([*compose, "restart", "-t", "20", "coordinator"])
    _until("the restarted coordinator", lambda: healthy(http), 240, logs)
    after = http.get(f"/v1/tasks/{task_id}").json()
    log_after = http.get(f"/v1/tasks/{task_id}/log").json()
    snap_after = http.get(f"/v1/tasks/{task_id}/snapshots/{ROUNDS}")
    snap0 = http.get(f"/v1/tasks/{task_id}/snapshots/0")
    spec = http.get(f"/v1/tasks/{task_id}/spec").json()

    # Assert: rounds, device checksums, production settings, nothing lost, replay
    assert uid == str(IMAGE_UID)
    assert before["version"] == ROUNDS
    assert [r["version"] for r in records] == list(range(1, ROUNDS + 1))
    assert all(r["participants"] == 2 and not r["failures"] for r in records)
    assert set(records[-1]["device_checksums"].values()) == {before["checksum"]}
    assert len(records[-1]["device_checksums"]) == 2
    assert (after["version"], after["checksum"]) == (before["version"], before["checksum"])
    assert log_after == log_before and len(log_before) == ROUNDS
    assert snap_before.status_code == snap_after.status_code == 200
    assert snap_after.content == snap_before.content
    env = _run(["docker", "exec", coordinator, "printenv", "SEEDFED_DATABASE_URL"]).stdout
    assert env.startswith("postgresql+psycopg://")
    assert http.get(f"/v1/tasks/{task_id}", headers={"Authorization": "Bearer wrong"}
                    ).status_code == 401
    replayed = _replay_here(work, spec, snap0.content, log_before)
    assert replayed == before["checksum"]


def _replay_here(work: Path, spec: dict, snapshot0: bytes, log: list[dict]) -> str:
    """Version 0 plus the coordinator's log, replayed in this process: the final checksum."""
    from seedfed.client.sync import load_state
    from seedfed.shared.model.factory import build_model
    from seedfed.shared.model.replay import checksum, replay
    from seedfed.shared.protocol.task import TaskSpec
    from seedfed.shared.protocol.wire import LogEntryWire

    spec = {**spec, "model_path": str(work / "models" / "tiny")}
    bundle = build_model(TaskSpec.from_dict(spec), initialize=False)
    load_state(bundle.scope, snapshot0)
    entries = [LogEntryWire.model_validate(e).to_entry() for e in log]
    replay(bundle.scope, entries, task_id=entries[0].task_id, version=0)
    return checksum(bundle.scope)
