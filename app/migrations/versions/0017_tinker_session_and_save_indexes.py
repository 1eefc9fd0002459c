"""Two indexes for bounds on what Tinker tenants leave behind (probe 2, findings 6 and 11):

- the finished Tinker sessions by when they finished (partial): the sweeper purges those finished
  before the retention (`app.tinker.service.purge_finished_sessions`), a chunk at a time, and without
  it each chunk read every session ever opened (a tenant could finish 85 a second);
- the futures by tenant and kind: the checkpoint listings and the quota on saved training states
  (`app.tinker.checkpoints`) read a tenant's saves without its other retained futures.

Revision ID: 0017
Revises: 0016
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINISHED = "finished_at IS NOT NULL"


def upgrade() -> None:
    op.create_index(
        "ix_tinker_sessions_finished",
        "tinker_sessions",
        ["finished_at"],
        postgresql_where=sa.text(FINISHED),
        sqlite_where=sa.text(FINISHED),
    )
    op.create_index("ix_tinker_futures_tenant_kind", "tinker_futures", ["tenant_id", "kind"])


def downgrade() -> None:
    op.drop_index("ix_tinker_futures_tenant_kind", table_name="tinker_futures")
    op.drop_index("ix_tinker_sessions_finished", table_name="tinker_sessions")
