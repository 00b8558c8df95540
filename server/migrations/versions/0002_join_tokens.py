"""Join tokens of their own: several per task, each with a device limit, rotation, revocation.

Each existing task's join token moves into `join_tokens` (same hash, no explicit limit, its
enrolled devices counted), so devices keep enrolling with the token they were given.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op
from seedfed.server.orm import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "join_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("task_id", sa.String(32), sa.ForeignKey("tasks.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("max_devices", sa.Integer(), nullable=True),
        sa.Column("enrolled", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_join_tokens_task_id", "join_tokens", ["task_id"])
    op.add_column("devices", sa.Column("join_token_id", sa.String(32), nullable=True))
    conn = op.get_bind()
    tasks = conn.execute(sa.text("SELECT id, join_token_hash, created_at FROM tasks")).all()
    for task_id, token_hash, created_at in tasks:
        n = conn.execute(sa.text("SELECT count(*) FROM devices WHERE task_id = :t"),
                         {"t": task_id}).scalar() or 0
        # A stable id derived from the hash: re-running a failed upgrade gives the same rows.
        token_id = hashlib.sha256(f"join-token:{token_hash}".encode()).hexdigest()[:16]
        conn.execute(sa.text(
            "INSERT INTO join_tokens (id, task_id, token_hash, max_devices, enrolled, "
            "created_at, revoked_at) VALUES (:i, :t, :h, NULL, :n, :c, NULL)"),
            {"i": token_id, "t": task_id, "h": token_hash, "n": n, "c": created_at})


def downgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("join_token_id")
    op.drop_index("ix_join_tokens_task_id", table_name="join_tokens")
    op.drop_table("join_tokens")
