"""Each batch's reward summary (count, mean, M2, min, max: app.rollouts.service.Summary), written at
ingestion, so that a trainer step's `trained_reward` merges exactly the batches it trained
(app/adapters/metrics_view.py) instead of pooling their rollout steps whole (a rollout step whose
batches two steps trained counted whole in both). Nullable: batches stored before this revision keep
NULL (their payloads are not read again), and the metrics fall back to their rollout step's stats.

Revision ID: 0019
Revises: 0018
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    ("reward_count", sa.Integer()),
    ("reward_mean", sa.Float()),
    ("reward_m2", sa.Float()),
    ("reward_min", sa.Float()),
    ("reward_max", sa.Float()),
)


def upgrade() -> None:
    for name, type_ in COLUMNS:
        op.add_column("batches", sa.Column(name, type_, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches", schema=None) as batch_op:
        for name, _ in reversed(COLUMNS):
            batch_op.drop_column(name)
