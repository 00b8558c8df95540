"""Initial schema: tasks, devices, rounds, uploads, versions.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from seedfed.server.orm import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("format", sa.String(16), nullable=False),
        sa.Column("quorum", sa.Integer(), nullable=False),
        sa.Column("round_timeout_s", sa.Float(), nullable=False),
        sa.Column("devices_per_round", sa.Integer(), nullable=True),
        sa.Column("join_token_hash", sa.String(64), nullable=False),
        sa.Column("secret", sa.String(64), nullable=False),
        sa.Column("current_version", sa.Integer(), nullable=False),
        sa.Column("scope_numel", sa.BigInteger(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )
    op.create_table(
        "devices",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("task_id", sa.String(32), sa.ForeignKey("tasks.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("last_seen_at", UTCDateTime(), nullable=True),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
    )
    op.create_index("ix_devices_task_id", "devices", ["task_id"])
    op.create_table(
        "rounds",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("task_id", sa.String(32), sa.ForeignKey("tasks.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("base_version", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("plan_json", sa.Text(), nullable=False),
        sa.Column("quorum", sa.Integer(), nullable=False),
        sa.Column("deadline", UTCDateTime(), nullable=False),
        sa.Column("opened_at", UTCDateTime(), nullable=False),
        sa.Column("closed_at", UTCDateTime(), nullable=True),
        sa.Column("participants", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("upload_bytes", sa.BigInteger(), nullable=False),
        sa.Column("aggregation_s", sa.Float(), nullable=True),
        sa.Column("result_version", sa.Integer(), nullable=True),
        sa.UniqueConstraint("task_id", "number", name="uq_rounds_task_number"),
    )
    op.create_index("ix_rounds_task_id", "rounds", ["task_id"])
    op.create_index("ix_rounds_task_state", "rounds", ["task_id", "state"])
    op.create_table(
        "uploads",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("device_id", sa.String(32), sa.ForeignKey("devices.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("cols", sa.Integer(), nullable=False),
        sa.Column("scalars", sa.LargeBinary(), nullable=False),
        sa.Column("num_examples", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("wire_bytes", sa.Integer(), nullable=False),
        sa.Column("received_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("round_id", "device_id", name="uq_uploads_round_device"),
    )
    op.create_index("ix_uploads_round", "uploads", ["round_id"])
    op.create_table(
        "versions",
        sa.Column("task_id", sa.String(32), sa.ForeignKey("tasks.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("version", sa.Integer(), primary_key=True),
        sa.Column("round_number", sa.Integer(), nullable=True),
        sa.Column("seeds_json", sa.Text(), nullable=False),
        sa.Column("coefs", sa.LargeBinary(), nullable=False),
        sa.Column("checksum", sa.String(64), nullable=False),
        sa.Column("master_path", sa.String(400), nullable=False),
        sa.Column("master_sha256", sa.String(64), nullable=False),
        sa.Column("master_bytes", sa.BigInteger(), nullable=False),
        sa.Column("snapshot_path", sa.String(400), nullable=False),
        sa.Column("snapshot_sha256", sa.String(64), nullable=False),
        sa.Column("snapshot_bytes", sa.BigInteger(), nullable=False),
        sa.Column("noise_std", sa.Float(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("versions")
    op.drop_index("ix_uploads_round", table_name="uploads")
    op.drop_table("uploads")
    op.drop_index("ix_rounds_task_state", table_name="rounds")
    op.drop_index("ix_rounds_task_id", table_name="rounds")
    op.drop_table("rounds")
    op.drop_index("ix_devices_task_id", table_name="devices")
    op.drop_table("devices")
    op.drop_table("tasks")
