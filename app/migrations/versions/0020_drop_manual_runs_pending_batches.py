"""Delete the pending rollout batches of manual runs (Tinker models' runs, `config.mode` manual).

Batches sent to a manual run through /v1 were stored until the ingestion refused them (409
`run_is_manual`, app/batches/service.py); no claim takes them since (app/batches/claims.py: a batch
trained into a manual run would use up the gradients its user accumulated), so they stayed pending
for ever, counted as queued. Trained ones stay (the run's history). Claimed ones stay too: one is
held by a pool that may still ack it (a deleted row would make that ack a 409); one claimed before
the claims skipped manual runs and never acked goes back to pending at its lease's end, and stays
there until its run is deleted.

Rows only: a migration does not touch the data directory. Each payload file (runs/<id>/rollouts/...)
is then one no row references, which the service's start-up removes (`remove_orphan_payloads`,
app/lifecycle.py), as it removes those a crash left between a file and its commit; until then it is
never read (a pool reads payloads through rows only). Deleting the run takes its whole directory.

The deleted rows and their bytes are added to `purged_counts` ("batches", "batch_bytes", as the
retention purge adds the batches it deletes: app/telemetry/purged.py), so that the
loraloom_batches_ingested counters, read from row counts, do not go down. The names and the
predicate are spelt out here: a migration must not change when the app's code does. Plain SQL, so
`alembic upgrade --sql` writes it out too.

Not reversible: the downgrade leaves the rows deleted.

Revision ID: 0020
Revises: 0019
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MANUAL_MODE = {
    "postgresql": "config ->> 'mode' = 'manual'",
    "sqlite": "json_extract(config, '$.mode') = 'manual'",
}
"""A manual run: its validated RunConfig's `mode` (`runs.config` is JSON on both backends)."""


def _doomed(dialect: str) -> str:
    return f"state = 'pending' AND run_id IN (SELECT id FROM runs WHERE {MANUAL_MODE[dialect]})"


def _add_purged(name: str, total: str, doomed: str) -> str:
    """Add `total` over the doomed rows to the purged count `name` (an upsert; nothing when 0). The
    total is taken in a subquery: an aggregate's HAVING without GROUP BY is refused by SQLite < 3.39."""
    return (
        f"INSERT INTO purged_counts (name, value) "
        f"SELECT '{name}', n FROM (SELECT {total} AS n FROM batches WHERE {doomed}) AS doomed WHERE n > 0 "
        "ON CONFLICT (name) DO UPDATE SET value = purged_counts.value + excluded.value"
    )


def upgrade() -> None:
    doomed = _doomed(op.get_context().dialect.name)
    op.execute(_add_purged("batches", "count(*)", doomed))
    op.execute(_add_purged("batch_bytes", "COALESCE(sum(payload_bytes), 0)", doomed))
    op.execute(f"DELETE FROM batches WHERE {doomed}")


def downgrade() -> None:
    pass  # the deleted batches were never to be trained; nothing brings them back
