"""Tenant names unique whatever their case, and the ids of runs deleted with their tenant.

- `uq_tenants_lower_name`: a unique index on lower(name), so that `Acme` and `acme` can no longer be two
  tenants (the admin API answers such a name 409, as a duplicate). Rows that already collide make the
  upgrade fail, naming them: which of two tenants keeps its name is the operator's choice (rename or
  delete one, then upgrade again), never the migration's. Names are ASCII (the API's pattern), where
  lower() agrees on both backends.
- `deleted_run_ids`: a tenant's deletion removes its runs' rows (ON DELETE CASCADE), so `POST
  /v1/pool/runs/deleted` could not name them and their files stayed on a pool with its own checkpoint
  directory; their ids are kept here, as long as a deleted run's row is (app/retention.py).

Revision ID: 0023
Revises: 0022
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from alembic.util import CommandError

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME_INDEX = "uq_tenants_lower_name"

COLLIDING_NAMES = (
    "SELECT name FROM tenants WHERE lower(name) IN "
    "(SELECT lower(name) FROM tenants GROUP BY lower(name) HAVING count(*) > 1) "
    "ORDER BY lower(name), name"
)


def _refuse_colliding_names() -> None:
    """Fail, naming every colliding group, if two tenants' names differ only in case."""
    if op.get_context().as_sql:  # `upgrade --sql`: no rows to read; the index itself refuses them
        return
    names = [row[0] for row in op.get_bind().execute(sa.text(COLLIDING_NAMES))]
    if not names:
        return
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.lower(), []).append(name)
    listed = "; ".join(", ".join(repr(n) for n in group) for group in groups.values())
    # CommandError: `loraloom db upgrade` prints its message as the error (no traceback).
    raise CommandError(
        f"migration 0023 makes tenant names unique whatever their case, and these tenants' names "
        f"differ only in case: {listed}. Rename or delete all but one of each (nothing was changed), "
        "then upgrade again."
    )


def upgrade() -> None:
    _refuse_colliding_names()
    op.create_index(NAME_INDEX, "tenants", [sa.text("lower(name)")], unique=True)
    op.create_table(
        "deleted_run_ids",
        sa.Column("run_id", sa.String(length=16), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_deleted_run_ids")),
    )
    op.create_index("ix_deleted_run_ids_deleted_at", "deleted_run_ids", ["deleted_at"])


def downgrade() -> None:
    op.drop_index("ix_deleted_run_ids_deleted_at", table_name="deleted_run_ids")
    op.drop_table("deleted_run_ids")
    op.drop_index(NAME_INDEX, table_name="tenants")
