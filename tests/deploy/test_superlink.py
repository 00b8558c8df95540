"""End to end on real Flower deployment processes: a `seedfed coordinator`, a
`flower-superlink` and two `flower-supernode`s on 127.0.0.1 (insecure HTTP), the app in
deploy/flower submitted with `flwr run`. Two rounds later the coordinator's version has
advanced twice and both devices report the coordinator's checksum.

Every process runs in its own process group and is killed in teardown; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
ADMIN = "deploy-test-admin-token-0123456789"
ROUNDS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(what: str, ok: Callable[[], bool], timeout: float, procs: list) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        for name, p, logf in procs:
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode} while waiting for "
                                     f"{what}:\n{Path(logf).read_text()[-3000:]}")
        time.sleep(0.5)
    logs = "\n".join(f"--- {n}\n{Path(f).read_text()[-2000:]}" for n, _, f in procs)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict]:
    for tool in ("flower-superlink", "flower-supernode", "flwr", "seedfed"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH (install seedfed[fleet])")
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "HF_HUB_OFFLINE": "1", "FLWR_HOME": str(tmp_path / "flwr-home"),
           "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    procs: list[tuple[str, subprocess.Popen, str]] = []

    def start(name: str, args: list[str], extra: dict[str, str] | None = None) -> None:
        logf = str(tmp_path / f"{name}.log")
        with open(logf, "w") as out:
            p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                 env={**env, **(extra or {})}, start_new_session=True)
        procs.append((name, p, logf))

    try:
        yield {"tmp": tmp_path, "env": env, "start": start, "procs": procs}
    finally:
        _stop([p for _, p, _ in reversed(procs)])


def _stop(popens: list[subprocess.Popen]) -> None:
    """Terminate each process with every descendant (SuperNodes spawn SuperExec and ClientApp
    processes of their own), then kill what is left after a grace period."""
    victims: list[psutil.Process] = []
    for p in popens:
        try:
            root = psutil.Process(p.pid)
            victims += [*root.children(recursive=True), root]
        except psutil.NoSuchProcess:
            continue
    for v in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.terminate()
    _, alive = psutil.wait_procs(victims, timeout=10)
    for v in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            v.kill()
    psutil.wait_procs(alive, timeout=10)


def test_two_rounds_on_superlink_and_two_supernodes(cluster: dict) -> None:
    tmp, start, procs = cluster["tmp"], cluster["start"], cluster["procs"]
    model = make_tiny_bert(tmp / "model")
    data = write_sentiment_tsv(tmp / "data.tsv")
    coord_port, link_port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{coord_port}"

    # the coordinator, and a task for the fleet (quorum: both devices)
    start("coordinator", ["seedfed", "coordinator", "--db", f"sqlite:///{tmp / 'c.db'}",
                          "--store", str(tmp / "store"), "--admin-token", ADMIN,
                          "--host", "127.0.0.1", "--port", str(coord_port)])
    http = httpx.Client(base_url=url, timeout=30,
                        headers={"Authorization": f"Bearer {ADMIN}"})

    def healthy() -> bool:
        try:
            return http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    _wait("the coordinator", healthy, 90, procs)
    spec = {"model_path": str(model), "label_texts": ["bad", "good"], "max_seq_len": 16,
            "hyper": {"lr": 1e-3, "eps": 1e-2, "steps": 2, "perturbations": 2,
                      "batch_size": 8}}
    created = http.post("/v1/tasks", json={"spec": spec, "quorum": 2}).json()
    task_id, join = created["task_id"], created["join_token"]

    # the SuperLink (its ServerApp reaches the coordinator over REST) and two SuperNodes
    start("superlink", ["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port",
                        str(link_port), "--disable-runtime-dependency-installation"],
          {"SEEDFED_ADMIN_TOKEN": ADMIN, "SEEDFED_JOIN_TOKEN": join,
           "SEEDFED_COORDINATOR_URL": url})
    _wait("the SuperLink", lambda: _open(link_port), 60, procs)
    for i in range(2):
        start(f"supernode{i}", [
            "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{link_port}",
            "--port", str(_free_port()),
            "--node-config", f'data="{data}" partition-id={i} num-partitions=2 alpha=1.0'])

    # submit the app; the CLI gets a Flower home of its own (the SuperNodes write theirs)
    home = tmp / "cli-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
        f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
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

    _wait("two rounds and the report", report.is_file, 300, procs)

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


def _open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
