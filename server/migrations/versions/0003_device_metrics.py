"""Device metrics: each device's held-out scores per round (shared, personalized, local-only).

One row per device and round (a later report replaces the earlier one); nothing of the
existing tables changes, so the upgrade only adds the table and the downgrade only drops it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from seedfed.server.orm import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_metrics",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("round_id", sa.Integer(), sa.ForeignKey("rounds.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("device_id", sa.String(32), sa.ForeignKey("devices.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("num_examples", sa.Integer(), nullable=False),
        sa.Column("shared_accuracy", sa.Float(), nullable=False),
        sa.Column("personal_accuracy", sa.Float(), nullable=True),
        sa.Column("local_accuracy", sa.Float(), nullable=True),
        sa.Column("reported_at", UTCDateTime(), nullable=False),
        sa.UniqueConstraint("round_id", "device_id", name="uq_device_metrics_round_device"),
    )


def downgrade() -> None:
    op.drop_table("device_metrics")
