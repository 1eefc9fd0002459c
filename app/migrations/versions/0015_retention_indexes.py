"""Indexes for the retention purge (app/retention.py): the deleted runs by deletion time (a partial
index on runs.updated_at, deleted runs only), which the sweeper walks oldest first, and
tinker_sampling_sessions.run_id, the one foreign key to runs without an index (deleting a run then
read every sampling session of every tenant, once per run).

Revision ID: 0015
Revises: 0014
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The predicate as of this revision (a migration does not follow later edits of the model's).
DELETED = "status = 'deleted'"


def upgrade() -> None:
    op.create_index(
        "ix_runs_deleted_updated_at",
        "runs",
        ["updated_at"],
        postgresql_where=sa.text(DELETED),
        sqlite_where=sa.text(DELETED),
    )
    op.create_index(
        op.f("ix_tinker_sampling_sessions_run_id"), "tinker_sampling_sessions", ["run_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_tinker_sampling_sessions_run_id"), table_name="tinker_sampling_sessions")
    op.drop_index("ix_runs_deleted_updated_at", table_name="runs")
