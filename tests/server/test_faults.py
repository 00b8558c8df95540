"""Faults that pass: the database unavailable mid-round (PostgreSQL refusing connections,
SQLite locked) and the model store's disk full. Each must answer a typed 503 (not a
traceback), leave nothing half-written, and work again, with the same requests, once the
fault is gone."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load as st_load
from seedfed.server import db as server_db
from seedfed.server.app import create_app
from seedfed.server.errors import StoreUnavailableError
from seedfed.server.store import ModelStore
from seedfed.shared.model.factory import build_model
from seedfed.shared.model.replay import checksum, replay
from seedfed.shared.protocol.task import TaskSpec
from seedfed.shared.protocol.wire import LogEntryWire, RoundPlan, Upload

from tests.server.conftest import fresh_pg_database, make_settings

ADMIN = {"Authorization": "Bearer admin-" + "x" * 20}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def setup_round(client: TestClient, spec: TaskSpec, devices: int = 2
                ) -> tuple[str, list[str], RoundPlan]:
    """A task whose rounds close only when told (quorum above the fleet), enrolled devices,
    an open round."""
    r = client.post("/v1/tasks", json={"spec": spec.to_dict(), "quorum": 50,
                                       "round_timeout_s": 3600}, headers=ADMIN)
    assert r.status_code == 201, r.text
    task_id, join = r.json()["task_id"], r.json()["join_token"]
    tokens = []
    for _ in range(devices):
        e = client.post(f"/v1/tasks/{task_id}/devices", json={"join_token": join})
        assert e.status_code == 201, e.text
        tokens.append(e.json()["token"])
    p = client.post(f"/v1/tasks/{task_id}/rounds", headers=ADMIN)
    assert p.status_code in (200, 201), p.text
    return task_id, tokens, RoundPlan.model_validate_json(p.content)


def body(plan: RoundPlan, seed: int) -> str:
    g = np.random.default_rng(seed).normal(size=(plan.steps, plan.perturbations))
    return Upload.build(plan, g, 10, 0.5).model_dump_json()


def upload(client: TestClient, task_id: str, plan: RoundPlan, token: str, seed: int):  # noqa: ANN201
    return client.post(f"/v1/tasks/{task_id}/rounds/{plan.round}/uploads",
                       content=body(plan, seed),
                       headers={**bearer(token), "Content-Type": "application/json"})


def assert_unavailable(r, error: str) -> None:  # noqa: ANN001
    assert r.status_code == 503, r.text
    payload = r.json()
    assert payload["error"] == error
    assert "retry later" in payload["detail"] and "Traceback" not in r.text
    assert r.headers["Retry-After"].isdigit()


def close_and_check_replay(client: TestClient, task_id: str, spec: TaskSpec,
                           participants: int) -> None:
    """Close the round (or see that the ticker's retry did), then rebuild v1 from v0 + log."""
    r = client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)
    assert r.status_code in (200, 409), r.text
    deadline = time.time() + 30
    while client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()["version"] != 1:
        assert time.time() < deadline, "the round never closed after the fault ended"
        time.sleep(0.1)
    rounds = client.get(f"/v1/tasks/{task_id}/rounds", headers=ADMIN).json()
    first = rounds[0] if isinstance(rounds, list) else rounds["rounds"][0]
    assert first["participants"] == participants
    device = build_model(spec, initialize=False)
    device.scope.write(st_load(client.get(f"/v1/tasks/{task_id}/snapshots/0",
                                          headers=ADMIN).content))
    log = client.get(f"/v1/tasks/{task_id}/log?since=0", headers=ADMIN).json()
    entries = [LogEntryWire.model_validate(e).to_entry() for e in
               (log if isinstance(log, list) else log["entries"])]
    assert len(entries) == 1
    replay(device.scope, entries, task_id=task_id, version=0)
    status = client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()
    assert checksum(device.scope) == status["checksum"]


# --- SQLite locked --------------------------------------------------------------------------
def test_sqlite_locked_mid_round_answers_503_then_recovers(
        sqlite_url: str, tmp_path: Path, spec: TaskSpec,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: a short busy timeout (the default 30 s is for production), a round with one
    # upload in, and another connection holding SQLite's write lock.
    def quick_pragmas(dbapi_connection: object, record: object) -> None:
        cur = dbapi_connection.cursor()  # type: ignore[attr-defined]
        for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON",
                       "busy_timeout=200"):
            cur.execute(f"PRAGMA {pragma}")
        cur.close()

    monkeypatch.setattr(server_db, "_sqlite_pragmas", quick_pragmas)
    settings = make_settings(sqlite_url, tmp_path / "store", tick_interval_s=0.05)
    with TestClient(create_app(settings)) as client:
        task_id, tokens, plan = setup_round(client, spec)
        assert upload(client, task_id, plan, tokens[0], 1).status_code == 200
        lock = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            # Act: an upload and a close while the database is locked
            during = upload(client, task_id, plan, tokens[1], 2)
            close = client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        # Assert: typed 503s, nothing stored or closed; the same upload then works
        assert_unavailable(during, "DatabaseUnavailableError")
        assert_unavailable(close, "DatabaseUnavailableError")
        status = client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()
        assert status["state"] == "open" and status["version"] == 0
        assert upload(client, task_id, plan, tokens[1], 2).status_code == 200
        close_and_check_replay(client, task_id, spec, participants=2)


# --- PostgreSQL refusing connections --------------------------------------------------------
@pytest.fixture
def pg_database() -> Iterator[tuple[str, object]]:
    """A database of its own (this test takes it away from everyone connected to it)."""
    with fresh_pg_database("seedfed_fault") as (url, admin, name):
        yield url, (admin, name)


@pytest.mark.postgres
def test_postgres_unavailable_mid_round_answers_503_then_recovers(
        pg_database: tuple[str, object], tmp_path: Path, spec: TaskSpec) -> None:
    import sqlalchemy as sa

    url, (admin, name) = pg_database  # type: ignore[misc]
    settings = make_settings(url, tmp_path / "store", tick_interval_s=0.05)
    with TestClient(create_app(settings)) as client:
        task_id, tokens, plan = setup_round(client, spec)
        assert upload(client, task_id, plan, tokens[0], 1).status_code == 200
        # Arrange: the server refuses new connections and drops the coordinator's pool
        with admin.connect() as c:  # type: ignore[attr-defined]
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                              "WHERE datname = :n AND pid <> pg_backend_pid()"), {"n": name})
        try:
            # Act
            during = upload(client, task_id, plan, tokens[1], 2)
            status = client.get(f"/v1/tasks/{task_id}", headers=ADMIN)
            close = client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)
        finally:
            with admin.connect() as c:  # type: ignore[attr-defined]
                c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        # Assert: typed 503s (no address of the database in them), then the same requests work
        for r in (during, status, close):
            assert_unavailable(r, "DatabaseUnavailableError")
            assert "127.0.0.1" not in r.text and "5432" not in r.text
        assert client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()["state"] == "open"
        assert upload(client, task_id, plan, tokens[1], 2).status_code == 200
        close_and_check_replay(client, task_id, spec, participants=2)


# --- model store disk full ------------------------------------------------------------------
@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "16m") -> Iterator[Path]:
    """A tmpfs of `size` at `path` (root only); skips where mounting is impossible."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs for the disk-full test (needs root and "
                    f"CAP_SYS_ADMIN): {e}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True,
                       timeout=30)


def fill(path: Path) -> Path:
    """Fill the file system of `path` to the last byte; returns the filler file."""
    filler = path / "filler"
    # Unbuffered: a buffered file would retry its unwritten tail on close and raise there.
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    return filler


def version_files(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in store.rglob("*")
                  if p.is_file() and "filler" not in p.name)


def test_store_write_on_a_full_disk_leaves_no_partial_file(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "disk", "256k") as disk:
        store = ModelStore(disk)
        fill(disk)

        with pytest.raises(StoreUnavailableError, match="disk full"):
            store.write_bytes("tasks/t/master/v00000001.safetensors", b"x" * 100_000)

        assert version_files(disk) == []


def test_disk_full_during_close_answers_503_then_recovers(
        sqlite_url: str, tmp_path: Path, spec: TaskSpec) -> None:
    with small_tmpfs(tmp_path / "store") as store:
        settings = make_settings(sqlite_url, store, tick_interval_s=0.05)
        with TestClient(create_app(settings)) as client:
            task_id, tokens, plan = setup_round(client, spec)
            for i, t in enumerate(tokens):
                assert upload(client, task_id, plan, t, i).status_code == 200
            before = version_files(store)
            filler = fill(store)

            # Act: the close has to write version 1's master and snapshot files
            close = client.post(f"/v1/tasks/{task_id}/rounds/1/close", headers=ADMIN)

            # Assert: a typed 503, the version not committed, no file of v1 (or a temporary
            # one) left behind; and the close goes through once there is room again
            assert_unavailable(close, "StoreUnavailableError")
            assert "disk full" in close.json()["detail"]
            status = client.get(f"/v1/tasks/{task_id}", headers=ADMIN).json()
            assert status["version"] == 0
            assert version_files(store) == before
            os.unlink(filler)
            close_and_check_replay(client, task_id, spec, participants=2)
