"""`tinker_futures.lost_leases`: how many pools died, stopped or were replaced while running a Tinker
request. A request that has lost `app.tinker.leases.MAX_LOST_LEASES` leases fails instead of going back
to pending: one request that stops every pool that runs it (probe 2, finding 1: a sample that crashed
the pool was claimed again by the restarted pool, which died within a second) cannot stop them forever.
Existing rows start at 0.

Revision ID: 0016
Revises: 0015
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tinker_futures", sa.Column("lost_leases", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )


def downgrade() -> None:
    with op.batch_alter_table("tinker_futures", schema=None) as batch_op:
        batch_op.drop_column("lost_leases")
