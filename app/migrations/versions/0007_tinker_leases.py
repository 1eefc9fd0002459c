"""tinker_futures.pool_id: the pool that holds a future's work (its claim, or a forward_backward's gradient)

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("tinker_futures", sa.Column("pool_id", sa.String(length=32), nullable=True))
    with op.batch_alter_table("tinker_futures", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tinker_futures_pool_id"), ["pool_id"], unique=False)
        # The retention purge reads done futures by completion time.
        batch_op.create_index(batch_op.f("ix_tinker_futures_completed_at"), ["completed_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("tinker_futures", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tinker_futures_completed_at"))
        batch_op.drop_index(batch_op.f("ix_tinker_futures_pool_id"))
    op.drop_column("tinker_futures", "pool_id")
