"""Engine and session factory; `alembic upgrade head` run programmatically at start.

SQLite runs in WAL mode with synchronous=NORMAL (durable across process crashes, which is the
failure the coordinator recovers from; a power cut may lose the last commits but never
corrupts) and a busy timeout. Its file holds every task's secret (the seeds and DP noise
derive from it), so it is created readable by its owner only (0600; SQLite gives the -wal and
-shm files the database file's mode), and an existing file open to others is narrowed to
that, with a warning. PostgreSQL needs nothing special.
"""

from __future__ import annotations

import logging
import os
import stat
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


logger = logging.getLogger("seedfed.server")

#: Mode of the SQLite database file: owner read/write only.
SQLITE_MODE = 0o600


def private_file(path: Path) -> None:
    """Create `path` with mode 0600 if it does not exist (whatever the umask), or narrow an
    existing file that group or others may read or write to 0600."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, SQLITE_MODE)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            os.chmod(path, SQLITE_MODE)
            logger.warning("the database file %s was open to others (mode %o); it holds the "
                           "task secrets: narrowed to %o", path, mode, SQLITE_MODE)
        return
    os.close(fd)


def make_engine(url: str, *, echo: bool = False) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ValueError("the coordinator needs a SQLite file (WAL), not an in-memory "
                             f"database: got {url!r}")
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        private_file(Path(parsed.database))
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False,
                                                             "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, echo=echo, pool_size=10, max_overflow=20, pool_pre_ping=True)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(engine: Engine) -> Config:
    script_dir = resources.files("seedfed.server") / "migrations"
    cfg = Config()
    cfg.set_main_option("script_location", str(script_dir))
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision` (idempotent)."""
    command.upgrade(alembic_config(engine), revision)


def downgrade(engine: Engine, revision: str = "base") -> None:
    command.downgrade(alembic_config(engine), revision)
