"""The newest live save of each Tinker checkpoint path is current again where migration 0021 marked it
superseded: 0021 ranked every completed save of a path, deleted ones too, and kept only the first
current. A path whose newest save (by request number) was deleted and whose older save completed
after that delete (the pool may post results out of request order; the delete marks the saves it
finds, app.tinker.checkpoints `delete_checkpoint`) named that older save before 0021, and names it
again since 0021 when it happens (app.tinker.work `_supersede_older_saves` supersedes lower request
numbers only). In rows ranked by 0021 it was left superseded beside a deleted current save: the
path stopped loading, resolving and listing, and the pruning no longer kept its adapter.

So: the completed save of each path (model, kind and the path its result names) that ranks first
among the saves not deleted, by request number, then completion time, then id (as a path's reads
rank them, and 0021), is no longer superseded. A no-op for rows the app marked: a save the app
superseded has a newer save of its path that was not deleted (a delete after the newer save's
completion marks the older too). The deleted save 0021 left current stays current: nothing reads a
deleted save but the saved-states quota, which counts a path once however many of its saves are.

Names and predicates spelt out here: a migration must not change when the app's code does. Plain
SQL, so `alembic upgrade --sql` writes it out too. Data only: the downgrade leaves the rows as they
are (0021's downgrade drops the column).

Revision ID: 0022
Revises: 0021
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SAVE_KINDS = "'save_weights', 'save_weights_for_sampler'"

RESULT_KEY = {
    "postgresql": "result ->> '{key}'",
    "sqlite": "json_extract(result, '$.{key}')",
}
"""A key of a future's result, as text (`tinker_futures.result` is JSON on both backends)."""

DELETED_MARK = "loraloom_deleted"
"""Set in a save's result when its checkpoint is deleted (`app.tinker.models.CHECKPOINT_DELETED`)."""


def _newest_live_superseded(dialect: str) -> str:
    """The ids of the superseded saves that rank first among their path's saves not deleted."""
    path = RESULT_KEY[dialect].format(key="path")
    deleted = RESULT_KEY[dialect].format(key=DELETED_MARK)
    return (
        "SELECT id FROM (SELECT id, superseded_at, row_number() OVER ("
        f"PARTITION BY model_id, kind, {path} ORDER BY seq_id DESC, completed_at DESC, id DESC"
        f") AS newest FROM tinker_futures WHERE kind IN ({SAVE_KINDS}) AND status = 'complete' "
        f"AND completed_at IS NOT NULL AND {path} IS NOT NULL AND {deleted} IS NULL) AS ranked "
        "WHERE newest = 1 AND superseded_at IS NOT NULL"
    )


def upgrade() -> None:
    chosen = _newest_live_superseded(op.get_context().dialect.name)
    op.execute(f"UPDATE tinker_futures SET superseded_at = NULL WHERE id IN ({chosen})")


def downgrade() -> None:
    pass
