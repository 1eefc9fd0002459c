"""Retention: what tenants leave behind goes after a while, so that the database stays bounded by
what is live (the sweeper runs these, app/sweeper.py).

- A deleted run's row is kept `Settings.deleted_run_retention_seconds` after its deletion (its
  directory went at the deletion, app/projection.py), then deleted with every row about the run:
  its events and Tinker futures (which name the run, or its Tinker model, without a foreign key),
  then its batches, step metrics, adapters, checkpoints, rollout stats, Tinker sampling sessions
  and Tinker model (foreign keys to runs, ON DELETE CASCADE: deleted here first, a chunk at a time,
  so that the run's own DELETE cascades to nothing).
- The kept id of a run deleted with its tenant (app/tenants/models.py `DeletedRunId`, what the pool's
  `POST /v1/pool/runs/deleted` names in place of the row that went with the tenant) goes after the
  same retention, in the same chunks, first.
- Events older than `Settings.event_retention_seconds` are deleted, whoever they are about.
- A live run's step adapters past its newest `Settings.run_adapters_kept` go too, rows then files,
  save those something still refers to (app/adapters/pruning.py, with `delete_some`).

What the purge deletes of runs, batches (and their bytes) and step reports is added to totals
(app/telemetry/purged.py) in the same transaction, which the Prometheus counters add to the rows
left: they never go down.

Chunks: each call deletes at most `chunk` rows, in the caller's transaction, and the sweeper commits
each chunk on its own, so a backlog (a first purge of years of events, a run of a million batches)
never holds a long transaction or many locks. Two service processes sweeping at once: on Postgres
each chunk locks what it deletes and skips what another has locked (SKIP LOCKED), so they split the
work and never wait on each other's rows (no deadlock with the other jobs deleting events or
futures either: these statements never wait on a row); a run's own row is deleted only once nothing
about it is left. SQLite runs one writing transaction at a time.

What a client sees:
- A purged run is a 404, like a run that never existed. Its Idempotency-Key is free again: a create
  retried with it after the purge makes a new run instead of answering the deleted one. Hence the
  retention of at least a day (Settings): keys protect retries, which come within minutes.
- A Tinker model's id (`{session}:train:{n}`) is free again too: its futures go with the run,
  so a new model of that id never answers a request with the old model's result (futures are found
  by model id and seq_id, app/tinker/work.py).
- A run id is 48 random bits (contracts/ids.py), never derived from anything; one equal to a purged
  run's (a chance of one in 2**48 per purged run and creation) would start clean, since nothing in
  the database names the purged run any more.
- Cursors are keysets, not references to a row: a run list cursor is (created_at, id), a feed cursor
  or Last-Event-ID (txid, id) (app/events/feed.py); naming a purged row, they go on from the next
  row kept. On Postgres ids come from sequences and never come back. SQLite gives a new row the
  largest id in its table plus one, so deleting the newest event would give its id (one that a
  client's cursor may hold) to the next event, which that cursor would then skip: on SQLite the
  newest event is never deleted (one row, deleted once a newer one exists).
"""

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Select, delete, exists, func, select, text, true
from sqlalchemy.orm import InstrumentedAttribute, Session

from app.adapters.models import Adapter, Checkpoint, StepMetrics
from app.batches.models import Batch
from app.db import rows_changed
from app.events.models import Event
from app.rollouts.models import RolloutStats
from app.runs.models import DELETED_RUNS, Run
from app.telemetry.purged import PURGED_BATCH_BYTES, PURGED_BATCHES, PURGED_RUNS, PURGED_STEPS, add_purged
from app.tenants.models import DeletedRunId
from app.tinker.models import TinkerFuture, TinkerModel, TinkerSamplingSession

log = logging.getLogger(__name__)

PURGE_CHUNK = 500
"""Rows one chunk (one transaction) deletes at most."""


@dataclass
class RunsPurged:
    """What one chunk of `purge_deleted_runs` did."""

    rows: int = 0
    """Rows deleted: the runs' own and the rows about them."""
    runs: list[str] = field(default_factory=list)
    """The runs whose rows are now all gone."""
    more: bool = False
    """The chunk used its whole budget: more may be due (the sweeper goes on with another chunk)."""


def _newest_event_stays(session: Session) -> ColumnElement[bool]:
    """On SQLite, not the newest event (see the module's docstring); on Postgres, any."""
    if session.get_bind().dialect.name != "sqlite":
        return true()
    return Event.id < select(func.max(Event.id)).scalar_subquery()


def delete_some(
    session: Session,
    pk: InstrumentedAttribute[Any],
    where: ColumnElement[bool],
    limit: int,
    *,
    order_by: InstrumentedAttribute[Any] | None = None,
) -> int:
    """Delete at most `limit` rows of `pk`'s table matching `where`, skipping rows another
    transaction holds (Postgres; SQLite has no row locks). Returns how many. Also the step
    adapters' pruning's (app/adapters/pruning.py)."""
    chosen = select(pk).where(where)
    if order_by is not None:
        chosen = chosen.order_by(order_by)
    chosen = chosen.limit(limit).with_for_update(skip_locked=True)
    return rows_changed(
        session,
        delete(pk.class_).where(pk.in_(chosen)).execution_options(synchronize_session=False),
    )


def _delete_batches(session: Session, where: ColumnElement[bool], limit: int) -> tuple[int, int]:
    """`delete_some` of batches, also giving their payload bytes (the ingested-bytes counter's)."""
    chosen = select(Batch.id).where(where).limit(limit).with_for_update(skip_locked=True)
    sizes = session.scalars(
        delete(Batch)
        .where(Batch.id.in_(chosen))
        .returning(Batch.payload_bytes)
        .execution_options(synchronize_session=False)
    ).all()
    return len(sizes), sum(sizes)


def due_runs_query(*, cutoff: datetime, chunk: int) -> Select[str]:
    """The ids of up to `chunk` runs deleted before `cutoff`, oldest deletion first, locked: another
    sweeper's chunk skips them. The predicate is stated literally, so that Postgres reads the partial
    index ix_runs_deleted_updated_at in a generic plan too (it cannot look into a bound parameter)."""
    return (
        select(Run.id)
        .where(text(DELETED_RUNS), Run.updated_at < cutoff)
        .order_by(Run.updated_at)
        .limit(chunk)
        .with_for_update(skip_locked=True)
    )


def purge_deleted_runs(
    session: Session, *, now: datetime, retention_seconds: float, chunk: int = PURGE_CHUNK
) -> RunsPurged:
    """One chunk of the purge of the runs deleted more than `retention_seconds` before `now`
    (0: none): at most `chunk` rows, the oldest deletions first. Never commits."""
    if retention_seconds <= 0:
        return RunsPurged()
    cutoff = now - timedelta(seconds=retention_seconds)
    # The kept ids of runs deleted with their tenant first: one row each, nothing else names them.
    kept_ids = delete_some(
        session,
        DeletedRunId.run_id,
        DeletedRunId.deleted_at < cutoff,
        chunk,
        order_by=DeletedRunId.deleted_at,
    )
    if kept_ids:
        log.info("retention: purged %s id(s) of runs deleted with their tenant before %s", kept_ids, cutoff)
    if kept_ids == chunk:
        return RunsPurged(rows=chunk, more=True)
    purged = _purge_due_runs(session, cutoff=cutoff, chunk=chunk - kept_ids)
    purged.rows += kept_ids
    return purged


def _purge_due_runs(session: Session, *, cutoff: datetime, chunk: int) -> RunsPurged:
    """`purge_deleted_runs` of the runs' rows, with what remains of its chunk."""
    doomed = list(session.scalars(due_runs_query(cutoff=cutoff, chunk=chunk)))
    if not doomed:
        return RunsPurged()
    models = list(session.scalars(select(TinkerModel.id).where(TinkerModel.run_id.in_(doomed))))
    # Rows with no foreign key to runs: the run's DELETE would leave them, so it waits for them.
    unbound: list[tuple[InstrumentedAttribute[Any], ColumnElement[bool]]] = [
        (Event.id, Event.run_id.in_(doomed) & _newest_event_stays(session)),
        (TinkerFuture.id, TinkerFuture.run_id.in_(doomed)),
    ]
    if models:  # a model's creation record names the model, not the run
        unbound.append((TinkerFuture.id, TinkerFuture.model_id.in_(models)))
    # Rows the run's DELETE would cascade to, unbounded: deleted here a chunk at a time. The Tinker
    # model goes after its futures, found through it.
    cascaded = [
        (column.class_.id, column.in_(doomed))
        for column in (
            Batch.run_id,
            StepMetrics.run_id,
            Adapter.run_id,
            Checkpoint.run_id,
            RolloutStats.run_id,
            TinkerSamplingSession.run_id,
            TinkerModel.run_id,
        )
    ]
    budget = chunk
    purged: dict[str, int] = {}
    for pk, where in [*unbound, *cascaded]:
        if pk is Batch.id:
            n, size = _delete_batches(session, where, budget)
            purged[PURGED_BATCHES], purged[PURGED_BATCH_BYTES] = n, size
        else:
            n = delete_some(session, pk, where, budget)
            if pk is StepMetrics.id:
                purged[PURGED_STEPS] = n
        budget -= n
        if budget == 0:
            add_purged(session, purged)
            return RunsPurged(rows=chunk, more=True)
    # A row skipped as locked (another job deleting it) or written since: the runs wait for a later chunk.
    if any(session.scalar(select(exists().where(where))) for _, where in unbound):
        add_purged(session, purged)
        return RunsPurged(rows=chunk - budget)
    gone = doomed[:budget]
    deleted = rows_changed(
        session,
        delete(Run).where(Run.id.in_(gone), text(DELETED_RUNS)).execution_options(synchronize_session=False),
    )
    budget -= deleted
    add_purged(session, purged | {PURGED_RUNS: deleted})
    log.info("retention: purged %s run(s) deleted before %s", deleted, cutoff.isoformat())
    return RunsPurged(rows=chunk - budget, runs=gone, more=budget == 0)


def purge_old_events(
    session: Session, *, now: datetime, retention_seconds: float, chunk: int = PURGE_CHUNK
) -> int:
    """One chunk of the purge of the events older than `retention_seconds` before `now` (0: none):
    at most `chunk`, the oldest first. Returns how many. Never commits."""
    if retention_seconds <= 0:
        return 0
    cutoff = now - timedelta(seconds=retention_seconds)
    where = (Event.at < cutoff) & _newest_event_stays(session)
    purged = delete_some(session, Event.id, where, chunk, order_by=Event.at)
    if purged:
        log.info("retention: purged %s event(s) older than %s", purged, cutoff.isoformat())
    return purged
