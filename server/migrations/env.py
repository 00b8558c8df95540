"""Alembic environment: the engine comes from the caller (seedfed.server.db.upgrade) or, for the
`alembic` command line, from SEEDFED_DATABASE_URL."""

from __future__ import annotations

import os

from alembic import context
from seedfed.server.orm import Base
from sqlalchemy import create_engine

target_metadata = Base.metadata
config = context.config


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        engine = create_engine(os.environ.get("SEEDFED_DATABASE_URL", "sqlite:///seedfed.db"))
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run online")
run_migrations_online()
