"""Round schedule and abandoned rounds: who opens a task's rounds, until which version, and why
a round ended without a version.

`tasks.schedule` is "auto" (the coordinator opens the next round when one ends) or "manual"
(only `POST .../rounds` opens one); tasks created before this revision ran their rounds by hand,
so they get "manual": an upgrade never starts rounds by itself (`seedfed round schedule ID
--auto` hands such a task to the schedule). `tasks.max_rounds` (nullable) stops the schedule at
that version. `rounds.abandon_reason` (nullable) keeps why a round was abandoned. The upgrade
only adds columns and the downgrade only drops them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


# Plain ALTER TABLE ADD / DROP COLUMN on both databases (SQLite >= 3.35 drops columns in
# place): a batch "recreate" of `tasks` would drop the parent table of every other one, which
# with SQLite's foreign keys on deletes their rows.
def upgrade() -> None:
    op.add_column("tasks", sa.Column("schedule", sa.String(16), nullable=False,
                                     server_default="manual"))
    op.add_column("tasks", sa.Column("max_rounds", sa.Integer(), nullable=True))
    op.add_column("rounds", sa.Column("abandon_reason", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("rounds", "abandon_reason")
    op.drop_column("tasks", "max_rounds")
    op.drop_column("tasks", "schedule")
