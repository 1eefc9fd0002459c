"""tinker_futures.tokens: what a request costs a pool's round, written at submit, so that the claim
cuts its rounds without loading each dealt request's JSON (one deferred load per row, every poll).

Requests already stored get their count here: a forward_backward's tokens over its data, a sample's
num_samples × (prompt + max_tokens), 0 for the rest (as app.tinker.work.work_tokens; spelt out here
because a migration must not change when the app's code does).

Revision ID: 0012
Revises: 0011
"""

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BACKFILL_BATCH = 500


def _tokens(request: dict[str, Any]) -> int:
    sampling = request.get("sampling")
    if sampling:
        return int(sampling["num_samples"]) * (len(sampling["prompt"]) + int(sampling["max_tokens"]))
    return sum(len(datum["tokens"]) for datum in request.get("data") or ())


def upgrade() -> None:
    op.add_column(
        "tinker_futures", sa.Column("tokens", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    futures = sa.table(
        "tinker_futures",
        sa.column("id", sa.String),
        sa.column("request", sa.JSON),
        sa.column("tokens", sa.Integer),
    )
    conn = op.get_bind()
    last = ""
    while True:  # in batches by id: a day of retained requests need not fit in memory at once
        rows = conn.execute(
            sa.select(futures.c.id, futures.c.request)
            .where(futures.c.id > last, futures.c.request.is_not(None))
            .order_by(futures.c.id)
            .limit(BACKFILL_BATCH)
        ).all()
        if not rows:
            break
        counted = []
        for row in rows:
            request = json.loads(row.request) if isinstance(row.request, str) else row.request
            if isinstance(request, dict) and (tokens := _tokens(request)):
                counted.append({"key": row.id, "tokens": tokens})
        if counted:
            conn.execute(
                futures.update()
                .where(futures.c.id == sa.bindparam("key"))
                .values(tokens=sa.bindparam("tokens")),
                counted,
            )
        last = rows[-1].id


def downgrade() -> None:
    with op.batch_alter_table("tinker_futures", schema=None) as batch_op:
        batch_op.drop_column("tokens")
