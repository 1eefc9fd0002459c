"""Index on ui_sessions.expires_at: the sweeper deletes the expired dashboard sessions a bounded batch
at a time (app.ui.sessions.purge_expired_sessions), and without it each batch read the whole table.

Revision ID: 0013
Revises: 0012
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(op.f("ix_ui_sessions_expires_at"), "ui_sessions", ["expires_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_ui_sessions_expires_at"), table_name="ui_sessions")
