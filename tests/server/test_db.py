"""The SQLite database file holds every task's secret: it is private to its owner (0600), with
its WAL files, whatever the umask; an existing file open to others is narrowed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from seedfed.server.db import make_engine, upgrade
from sqlalchemy import text


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_and_its_wal_files_are_readable_by_their_owner_only(
        tmp_path: Path) -> None:
    # Arrange: a permissive umask, as many shells have
    old = os.umask(0o022)
    try:
        db = tmp_path / "sub" / "coordinator.db"

        # Act: create, migrate, and write (SQLite creates -wal and -shm)
        engine = make_engine(f"sqlite:///{db}")
        upgrade(engine)
        with engine.begin() as c:
            c.execute(text("CREATE TABLE probe (x INTEGER)"))
            c.execute(text("INSERT INTO probe VALUES (1)"))
            modes = {p.name: _mode(p) for p in tmp_path.joinpath("sub").iterdir()}
        engine.dispose()
    finally:
        os.umask(old)

    # Assert
    assert modes["coordinator.db"] == 0o600
    assert {modes[f"coordinator.db-{s}"] for s in ("wal", "shm")} == {0o600}


def test_an_existing_database_open_to_others_is_narrowed_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    db = tmp_path / "coordinator.db"
    db.touch()
    db.chmod(0o644)

    make_engine(f"sqlite:///{db}").dispose()

    assert _mode(db) == 0o600
    assert "open to others (mode 644)" in caplog.text and "narrowed to 600" in caplog.text
