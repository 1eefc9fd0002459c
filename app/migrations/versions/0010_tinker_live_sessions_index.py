"""Partial index on the unfinished Tinker sessions by tenant and last heartbeat (app.tinker.models.
LIVE_SESSIONS): `create_session` counts a tenant's live sessions, and without it that count read every
session the tenant ever opened (each SDK ServiceClient opens one; finished ones stay, their models
reference them).

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNFINISHED = "finished_at IS NULL"


def upgrade() -> None:
    op.create_index(
        "ix_tinker_sessions_live",
        "tinker_sessions",
        ["tenant_id", "last_heartbeat_at"],
        postgresql_where=sa.text(UNFINISHED),
        sqlite_where=sa.text(UNFINISHED),
    )


def downgrade() -> None:
    op.drop_index("ix_tinker_sessions_live", table_name="tinker_sessions")
