"""tinker_base_turns: when a pool's claim last took a tenant's samples of a base model. Within a turn
the base-sample claim deals first to the tenant served longest ago, so that a round bounded in tokens
cannot be filled round after round by the tenant whose queue of samples is oldest.

Revision ID: 0011
Revises: 0010
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tinker_base_turns",
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("served_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tinker_base_turns_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", "model_id", name=op.f("pk_tinker_base_turns")),
    )


def downgrade() -> None:
    op.drop_table("tinker_base_turns")
