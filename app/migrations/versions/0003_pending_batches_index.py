"""Partial index on a run's pending batches: the per-run pending limits (app/limits.py) count
them on every submission.

Revision ID: 0003
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_batches_run_id_pending",
        "batches",
        ["run_id"],
        postgresql_where=sa.text("state = 'pending'"),
        sqlite_where=sa.text("state = 'pending'"),
    )


def downgrade() -> None:
    op.drop_index("ix_batches_run_id_pending", table_name="batches")
