"""Partial index on the Tinker futures a pool's claim can take (app.tinker.models.CLAIMABLE): the claim
polls every poll interval and read every retained future without it.

Revision ID: 0008
Revises: 0007
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The predicate as of this revision (a migration does not follow later edits of the model's constant).
CLAIMABLE = (
    "status = 'pending' OR (status = 'complete' AND kind IN ('forward_backward', 'load_weights') "
    "AND request IS NOT NULL AND CAST(request AS TEXT) <> 'null')"
)


def upgrade() -> None:
    op.create_index(
        "ix_tinker_futures_claimable",
        "tinker_futures",
        ["run_id", "seq_id"],
        postgresql_where=sa.text(CLAIMABLE),
        sqlite_where=sa.text(CLAIMABLE),
    )


def downgrade() -> None:
    op.drop_index("ix_tinker_futures_claimable", table_name="tinker_futures")
