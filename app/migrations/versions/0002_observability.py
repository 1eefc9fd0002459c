"""observability: the run event feed's order (events.txid), rewards per rollout step, dashboard sessions

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("txid", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
        batch_op.create_index("ix_events_run_feed", ["run_id", "txid", "id"], unique=False)

    op.create_table(
        "rollout_stats",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=16), nullable=False),
        sa.Column("rollout_step", sa.Integer(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("reward_count", sa.Integer(), nullable=False),
        sa.Column("reward_mean", sa.Float(), nullable=False),
        sa.Column("reward_m2", sa.Float(), nullable=False),
        sa.Column("reward_min", sa.Float(), nullable=True),
        sa.Column("reward_max", sa.Float(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rollout_stats_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_stats")),
        sa.UniqueConstraint("run_id", "rollout_step", name=op.f("uq_rollout_stats_run_id_rollout_step")),
    )
    with op.batch_alter_table("rollout_stats", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollout_stats_run_id"), ["run_id"], unique=False)

    op.create_table(
        "ui_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=True),
        sa.Column("api_key_id", sa.String(length=32), nullable=True),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        sa.Column("csrf_token", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_ui_sessions_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_ui_sessions")),
    )
    with op.batch_alter_table("ui_sessions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_ui_sessions_tenant_id"), ["tenant_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("ui_sessions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_ui_sessions_tenant_id"))
    op.drop_table("ui_sessions")
    with op.batch_alter_table("rollout_stats", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollout_stats_run_id"))
    op.drop_table("rollout_stats")
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_run_feed")
        batch_op.drop_column("txid")
