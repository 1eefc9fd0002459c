"""runs.init_from: the adapter a run starts from

Revision ID: 0004
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("init_from", sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("runs", "init_from")
