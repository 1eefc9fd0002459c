"""runs.init_from, tenant_adapters, pools.module_shapes/num_layers: runs that start from saved weights

Revision ID: 0004
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("init_from", sa.JSON(), nullable=True))
    op.add_column("pools", sa.Column("module_shapes", sa.JSON(), nullable=True))
    op.add_column("pools", sa.Column("num_layers", sa.Integer(), nullable=True))
    op.create_table(
        "tenant_adapters",
        sa.Column("id", sa.String(length=16), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("base_model", sa.String(length=256), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tenant_adapters_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenant_adapters")),
    )
    op.create_index(op.f("ix_tenant_adapters_tenant_id"), "tenant_adapters", ["tenant_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_tenant_adapters_tenant_id"), table_name="tenant_adapters")
    op.drop_table("tenant_adapters")
    op.drop_column("pools", "num_layers")
    op.drop_column("pools", "module_shapes")
    op.drop_column("runs", "init_from")
