"""tinker_models.served_at: when a pool's claim last took this model's work. Within a turn the claim
deals first to the model served longest ago (never served first), so that a round bounded in tokens
cannot be filled round after round by the one tenant whose queue is oldest.

Revision ID: 0009
Revises: 0008
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tinker_models", sa.Column("served_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tinker_models", schema=None) as batch_op:
        batch_op.drop_column("served_at")
