"""Totals of the rows the retention purge deleted (app/retention.py), added in the purge's own
transaction, and read by the collector on top of the rows left."""

from collections.abc import Mapping

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from app.telemetry.models import PurgedCount

PURGED_RUNS = "runs"
PURGED_BATCHES = "batches"
PURGED_BATCH_BYTES = "batch_bytes"
PURGED_STEPS = "steps"


def add_purged(session: Session, counts: Mapping[str, int]) -> None:
    """Add `counts` to the totals (an upsert per name; never commits). Two sweepers adding at once
    wait for each other's row here, last in their transactions, so no lock cycle can form."""
    insert = postgresql_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    for name, n in sorted(counts.items()):
        if n:
            stmt = insert(PurgedCount).values(name=name, value=n)
            session.execute(
                stmt.on_conflict_do_update(
                    index_elements=[PurgedCount.name], set_={"value": PurgedCount.value + stmt.excluded.value}
                )
            )


def purged_totals(session: Session) -> dict[str, int]:
    return {
        name: value for name, value in session.execute(select(PurgedCount.name, PurgedCount.value)).tuples()
    }
