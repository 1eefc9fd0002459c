"""`tinker_futures.superseded_at` and the partial index `ix_tinker_futures_current_saves`: the quotas
on Tinker saves (app.tinker.checkpoints `kept_query`) count a tenant's checkpoint paths on every
save_state and save_weights_for_sampler, under the tenant's lock, and read every completed save of
the tenant to do it. Completed saves are never purged, so a tenant saving under one name at every
step made that grow without end (207 ms a save at 50,000 saves of one name). A completed save is now
marked superseded when a newer save of its path completes (app.tinker.work.record_results), and the
index holds each path's newest save alone.

Existing rows: every completed save but the newest of its path (model, kind and the path its result
names; newest by completion time, then id, as the checkpoint listings order them) is marked, at the
migration's time. The predicate and the path are spelt out here: a migration must not change when
the app's code does. Plain SQL, so `alembic upgrade --sql` writes it out too.

Revision ID: 0021
Revises: 0020
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SAVE_KINDS = "'save_weights', 'save_weights_for_sampler'"
CURRENT_SAVES = f"kind IN ({SAVE_KINDS}) AND status = 'complete' AND superseded_at IS NULL"
"""The index's predicate (`app.tinker.models.current_saves`)."""

SAVED_PATH = {
    "postgresql": "result ->> 'path'",
    "sqlite": "json_extract(result, '$.path')",
}
"""The `tinker://` path a completed save's result names (`tinker_futures.result` is JSON on both)."""


def _superseded(dialect: str) -> str:
    """The ids of the completed saves a newer save of their path superseded: newer by the model's
    request number first, as a path's reads pick its save (`checkpoints.newest_save_query`), so a
    tie or a skew of completion times cannot leave an older step current. A save without a
    completion time is left alone: nothing counts or lists it (the backends order NULLs apart)."""
    return (
        "SELECT id FROM (SELECT id, row_number() OVER ("
        f"PARTITION BY model_id, kind, {SAVED_PATH[dialect]} ORDER BY seq_id DESC, completed_at DESC, id DESC"
        f") AS newest FROM tinker_futures WHERE kind IN ({SAVE_KINDS}) AND status = 'complete' "
        "AND completed_at IS NOT NULL) AS ranked WHERE newest > 1"
    )


def upgrade() -> None:
    op.add_column("tinker_futures", sa.Column("superseded_at", sa.DateTime(timezone=True), nullable=True))
    superseded = _superseded(op.get_context().dialect.name)
    op.execute(f"UPDATE tinker_futures SET superseded_at = CURRENT_TIMESTAMP WHERE id IN ({superseded})")
    op.create_index(
        "ix_tinker_futures_current_saves",
        "tinker_futures",
        ["tenant_id", "kind"],
        postgresql_where=sa.text(CURRENT_SAVES),
        sqlite_where=sa.text(CURRENT_SAVES),
    )


def downgrade() -> None:
    op.drop_index("ix_tinker_futures_current_saves", table_name="tinker_futures")
    with op.batch_alter_table("tinker_futures", schema=None) as batch_op:
        batch_op.drop_column("superseded_at")
