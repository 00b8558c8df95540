"""A real `seedfed coordinator` process for the benchmarks, and the data it serves.

What seedfed.bench.ingest, seedfed.bench.fuzz and `seedfed bench crash` share: a tiny BERT on
disk to build tasks from, a fresh database (a SQLite file or a PostgreSQL database of its own),
a task with enrolled devices written before the server starts, and the coordinator itself as a
subprocess (uvicorn, the real app) on a free loopback port, waited for until `/readyz` answers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from seedfed.shared.protocol.task import TaskSpec
    from seedfed.shared.protocol.wire import RoundPlan

PG_URL = os.environ.get("SEEDFED_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
#: What a coordinator subprocess runs with on top of the caller's environment.
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def tiny_model(path: Path) -> Path:
    """A 2-layer BERT classifier on disk (what the coordinator builds task models from)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "negative", "positive"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        BertForSequenceClassification(BertConfig(
            vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64)).save_pretrained(path)
    return path


@contextlib.contextmanager
def database(kind: str, tmp: Path, prefix: str = "seedfed_bench") -> Iterator[str]:
    """The URL of a fresh database: `kind` "sqlite" (a file in `tmp`) or "postgres" (a
    database of its own on `PG_URL`, named `<prefix>_<random>`, dropped afterwards)."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp / 'coordinator.db'}"
        return
    import sqlalchemy as sa

    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{secrets.token_hex(4)}"
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.engine.make_url(PG_URL).set(database=name).render_as_string(
            hide_password=False)
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def enroll_fleet(url: str, store: Path, admin_token: str, spec: TaskSpec, *, quorum: int,
                 devices: int, open_round: bool = False, round_timeout_s: float = 3600,
                 ) -> tuple[str, list[tuple[str, str]], RoundPlan | None]:
    """Write a task and `devices` enrolled devices straight into the database (in process,
    before any server runs): (task id, [(device id, token)], the open round's plan when
    `open_round`, else None)."""
    from seedfed.server import service
    from seedfed.server.coordinator import Coordinator
    from seedfed.server.settings import Settings

    with Coordinator.open(Settings(database_url=url, store_dir=store,
                                   admin_token=admin_token)) as c:
        task_id = c.create_task(spec, quorum=quorum, round_timeout_s=round_timeout_s)
        tokens = [service.enroll_device(c.rt, task_id=task_id, join_token=None)
                  for _ in range(devices)]
        plan = c.open_round(task_id) if open_round else None
    return task_id, tokens, plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(url: str, store: Path, admin_token: str, port: int, log: IO[bytes], *,
          env: Mapping[str, str] | None = None, args: Sequence[str] = ()
          ) -> subprocess.Popen[bytes]:
    """Start `seedfed coordinator` on 127.0.0.1:`port`, its output appended to `log`;
    `env` adds to the environment, `args` to the command line."""
    return subprocess.Popen(
        [sys.executable, "-c", "from seedfed.cli import main; main()", "coordinator",
         "--db", url, "--store", str(store), "--admin-token", admin_token,
         "--host", "127.0.0.1", "--port", str(port), *args],
        env={**os.environ, **QUIET_ENV, **(env or {})}, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(base: str, proc: subprocess.Popen[bytes], log_path: Path,
               timeout: float = 180.0, poll_s: float = 0.1) -> float:
    """Seconds until `base`/readyz answers 200; raises with the log's tail if the process
    exits or `timeout` passes first."""
    import httpx

    t0 = time.time()
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return time.time() - t0
        if proc.poll() is not None or time.time() - t0 > timeout:
            raise RuntimeError("coordinator did not start:\n"
                               + log_path.read_text(errors="replace")[-4000:])
        time.sleep(poll_s)


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def coordinator(url: str, store: Path, admin_token: str, log_path: Path, *,
                env: Mapping[str, str] | None = None, args: Sequence[str] = (),
                timeout: float = 180.0) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A ready coordinator process on a free loopback port: yields (base URL, process) and
    stops it on exit."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "ab") as log:
        proc = start(url, store, admin_token, port, log, env=env, args=args)
        try:
            wait_ready(base, proc, log_path, timeout)
            yield base, proc
        finally:
            stop(proc)
