"""Process helpers of the deployment tests: free ports, bounded waits, process-group teardown,
a Flower CLI home for one SuperLink connection, and a coordinator task for a fleet."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil

#: Hyperparameters of the tiny fleet tasks: two local steps of two seeds, so a round is fast.
TINY_SPEC = {"label_texts": ["bad", "good"], "max_seq_len": 16,
             "hyper": {"lr": 1e-3, "eps": 1e-2, "steps": 2, "perturbations": 2, "batch_size": 8}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(what: str, ok: Callable[[], bool], timeout: float,
             procs: list[tuple[str, subprocess.Popen, str]]) -> None:
    """Poll `ok` until it holds; fail early (with its log) when a watched process exits."""
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


def stop(popens: list[subprocess.Popen]) -> None:
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


def healthy(http: httpx.Client) -> bool:
    try:
        return http.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def flwr_home(home: Path, port: int, root_certificates: Path | None = None) -> Path:
    """A Flower CLI home whose default connection is the SuperLink on 127.0.0.1:`port`
    (TLS verified against `root_certificates`, or insecure without them)."""
    home.mkdir(parents=True, exist_ok=True)
    tls = (f'root-certificates = "{root_certificates}"\n' if root_certificates
           else "insecure = true\n")
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
        f'address = "127.0.0.1:{port}"\n{tls}')
    return home


def create_task(http: httpx.Client, model_path: str, quorum: int) -> tuple[str, str]:
    """A tiny-BERT task on the coordinator: (task id, join token)."""
    created = http.post("/v1/tasks", json={"spec": {"model_path": model_path, **TINY_SPEC},
                                           "quorum": quorum})
    assert created.status_code == 201, f"{created.status_code}: {created.text[:2000]}"
    body = created.json()
    return str(body["task_id"]), str(body["join_token"])
