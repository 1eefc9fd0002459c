"""Byte bounds per tenant: `tinker_futures.request_bytes` (the size of a stored request's JSON) with a
partial index over the unfinished futures, by which a tenant's waiting Tinker work is bounded in bytes
as well as in number; and `tenant_adapters.stored_bytes` (what an upload takes on disk), by which its
uploaded adapters are.

Unfinished requests already stored get their size here, measured in SQL (a queue can hold gigabytes
of JSON: reading it into Python while the service starts would be slow, and SQL is also written out by
`alembic upgrade --sql`); done ones keep 0, as nothing reads their size. Adapters already uploaded get
twice their files' bytes: their tar.gz is not measured here (a migration reads no files), and the
weights, floats, barely compress. A row an old process inserts afterwards counts 0 bytes until every
process is upgraded.

Revision ID: 0014
Revises: 0013
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The predicate as of this revision (a migration does not follow later edits of the model's).
UNFINISHED = "status IN ('pending', 'running')"

POSTGRES_SIZE = f"""
UPDATE tinker_futures SET request_bytes = octet_length(CAST(request AS TEXT))
WHERE request IS NOT NULL AND {UNFINISHED}
"""
SQLITE_SIZE = f"""
UPDATE tinker_futures SET request_bytes = length(CAST(request AS BLOB))
WHERE request IS NOT NULL AND {UNFINISHED}
"""


def upgrade() -> None:
    op.add_column(
        "tinker_futures",
        sa.Column("request_bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.execute(POSTGRES_SIZE if op.get_context().dialect.name == "postgresql" else SQLITE_SIZE)
    op.create_index(
        "ix_tinker_futures_unfinished",
        "tinker_futures",
        ["tenant_id", "status", "request_bytes"],
        postgresql_where=sa.text(UNFINISHED),
        sqlite_where=sa.text(UNFINISHED),
    )
    op.add_column(
        "tenant_adapters",
        sa.Column("stored_bytes", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
    )
    op.execute("UPDATE tenant_adapters SET stored_bytes = 2 * size_bytes")


def downgrade() -> None:
    with op.batch_alter_table("tenant_adapters", schema=None) as batch_op:
        batch_op.drop_column("stored_bytes")
    op.drop_index("ix_tinker_futures_unfinished", table_name="tinker_futures")
    with op.batch_alter_table("tinker_futures", schema=None) as batch_op:
        batch_op.drop_column("request_bytes")
