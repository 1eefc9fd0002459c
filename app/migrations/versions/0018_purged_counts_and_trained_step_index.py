"""purged_counts: what the retention purge deleted, so that Prometheus counters read from row counts
never go down; and batches by (run_id, trained_step), for the metrics join of a trainer step with
the batches it trained (app/adapters/metrics_view.py), which read all of a run's batches.

Revision ID: 0018
Revises: 0017
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "purged_counts",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_purged_counts")),
    )
    op.create_index("ix_batches_run_id_trained_step", "batches", ["run_id", "trained_step"])


def downgrade() -> None:
    op.drop_index("ix_batches_run_id_trained_step", table_name="batches")
    op.drop_table("purged_counts")
