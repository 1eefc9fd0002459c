"""The pool's hold on Tinker work, and how long done work is kept.

A claimed future is held by the pool that claimed it (`pool_id`) for as long as that pool is
alive: its lease is the pool's own heartbeat. Unlike a rollout batch, manual work is not handed
to another pool while its holder lives: the run's accumulated gradients are in that pool's memory,
and there is one pool per base model. When the pool dies, stops or is replaced, its running futures
return to pending (here), unless they have lost `MAX_LOST_LEASES` leases this way: then they fail (a
poison pill that stops every pool that runs it must not stop them forever). The complete
forward_backward / load_weights futures whose effect only it held are replayed by the next pool
(app.tinker.work.claim). A future that can no longer be served fails here, so that the retention
purges it like any done future: the work of a run that has left (evicted, deleted, failed,
completed), and a base-model sample no pool claimed in time. These functions touch tinker_futures
rows only (reading runs), so the pools service and the sweeper use them without the Tinker service.
"""

import logging
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Text, cast, delete, null, or_, select, update
from sqlalchemy.orm import Session

from app.db import rows_changed, utcnow
from app.runs.models import Run
from app.timestamps import as_utc
from app.tinker.models import TinkerFuture
from contracts.status import MOVABLE_RUN_STATUSES

log = logging.getLogger("loraloom.tinker")

PENDING, RUNNING = "pending", "running"
MAX_LOST_LEASES = 2
"""A running future whose pool dies (or stops, or is replaced) this many times fails instead of going
back to pending. A pool that dies loses every request of its round, so a request that kills the pool
that runs it would otherwise be claimed again by the restarted pool, which dies in turn, forever, for
every tenant (probe 2, finding 1: a sample request crash-looped the pool). 2, not 1: a pool also dies
for reasons of its own (killed, out of memory, the machine lost), and the requests it held then get
one more try. The innocent requests claimed in the same rounds as a poison pill fail with it; the pool
isolates each request's failure (trainer_core.manual), so this is the last line, not the first."""
LOST_LEASES_ERROR = (
    "the worker pool stopped {n} times while running this request (it died, or was replaced or "
    "declared dead, before answering it), so it was failed rather than handed to a pool again: a "
    "request that stops the pool would stop it for every tenant. It may not be the cause (another "
    "request of the same round may be); if not, send it again. An optim_step or load_weights may have "
    "been applied before the pool stopped"
)
KEPT_KINDS = ("create_model", "save_weights", "save_weights_for_sampler")
"""Futures that are the record of a model or of saved weights (`tinker://` paths resolve through
them): never purged, they live as long as their model."""


def request_cleared() -> ColumnElement[bool]:
    """The future's request is gone: SQL NULL, or the JSON null an ORM assignment of None stores."""
    return or_(TinkerFuture.request.is_(None), cast(TinkerFuture.request, Text) == "null")


def return_pool_work(session: Session, *, pool_id: str, now: datetime | None = None) -> int:
    """Every future a (dead, stopped or replaced) pool was running → pending, its lost lease counted;
    one that has now lost `MAX_LOST_LEASES` fails instead. Returns how many went back to pending.

    Its late results are refused from now on (app.tinker.work.record_results)."""
    held = (TinkerFuture.status == RUNNING, TinkerFuture.pool_id == pool_id)
    last_chance = TinkerFuture.lost_leases >= MAX_LOST_LEASES - 1
    poisoned = session.scalars(select(TinkerFuture.id).where(*held, last_chance)).all()
    if poisoned:
        rows_changed(
            session,
            update(TinkerFuture)
            .where(TinkerFuture.id.in_(poisoned), *held)
            .values(
                status="failed",
                pool_id=None,
                lost_leases=TinkerFuture.lost_leases + 1,
                error=LOST_LEASES_ERROR.format(n=MAX_LOST_LEASES),
                error_category="server",
                request=null(),
                completed_at=now or utcnow(),
            )
            .execution_options(synchronize_session=False),
        )
        log.warning(
            "pool %s: Tinker request(s) %s failed: every pool that ran them stopped (%s times)",
            pool_id,
            ", ".join(poisoned),
            MAX_LOST_LEASES,
        )
    returned = rows_changed(
        session,
        update(TinkerFuture)
        .where(*held)
        .values(status="pending", pool_id=None, lost_leases=TinkerFuture.lost_leases + 1)
        .execution_options(synchronize_session=False),
    )
    if returned:
        log.info("pool %s: %s Tinker request(s) returned to pending", pool_id, returned)
    return returned


def purge_done_futures(session: Session, *, now: datetime, ttl_seconds: float) -> int:
    """Delete the futures done (complete or failed) more than `ttl_seconds` ago. Returns how many.

    Kept: the records in KEPT_KINDS, and a future whose request is still needed to rebuild its
    run's current step after a pool crash (its request is cleared at the run's next optim_step)."""
    purged = rows_changed(
        session,
        delete(TinkerFuture)
        .where(
            TinkerFuture.status.in_(("complete", "failed")),
            TinkerFuture.completed_at < now - timedelta(seconds=ttl_seconds),
            TinkerFuture.kind.not_in(KEPT_KINDS),
            request_cleared(),
        )
        .execution_options(synchronize_session=False),
    )
    if purged:
        log.info("%s done Tinker future(s) older than %ss purged", purged, ttl_seconds)
    return purged


def fail_future(future: TinkerFuture, *, error: str, now: datetime) -> None:
    """Done with `error`: retrieve_future answers it, and the retention purges it."""
    future.status = "failed"
    future.error = error
    future.error_category = "user"
    future.request = None
    future.completed_at = now


def fail_if_run_left(future: TinkerFuture, run: Run | None, *, now: datetime) -> bool:
    """A pending or running future whose run (`run`: None when the row is gone) has left fails
    now, with the reason; returns whether it did."""
    if future.status not in (PENDING, RUNNING) or future.run_id is None:
        return False
    if run is not None and run.status in MOVABLE_RUN_STATUSES:
        return False
    status = "deleted" if run is None else run.status
    reason = None if run is None else (run.eviction_reason or run.failure_reason)
    fail_future(
        future,
        error=f"the model's run {future.run_id} left ({status}{': ' + reason if reason else ''})",
        now=now,
    )
    return True


def fail_work_of_left_runs(session: Session, *, now: datetime) -> int:
    """Fail every pending or running future whose run has left. Returns how many.

    A running one may still be in a pool's hands: its late result is ignored (record_results
    records only what the pool still holds), as for a future failed when polled."""
    rows = session.execute(
        select(TinkerFuture, Run)
        .outerjoin(Run, Run.id == TinkerFuture.run_id)
        .where(
            TinkerFuture.status.in_((PENDING, RUNNING)),
            TinkerFuture.run_id.is_not(None),
            or_(Run.id.is_(None), Run.status.not_in(MOVABLE_RUN_STATUSES)),
        )
        .with_for_update(of=TinkerFuture, skip_locked=True)
    ).all()
    failed = sum(fail_if_run_left(future, run, now=now) for future, run in rows)
    if failed:
        log.info("%s Tinker request(s) of runs that have left failed", failed)
    return failed


def fail_unclaimed_base_samples(session: Session, *, now: datetime, wait_seconds: float) -> int:
    """Fail the base-model sample requests still pending `wait_seconds` after they were made (no
    pool of their base model claimed them: none is alive, or it never came back). Returns how many."""
    futures = session.scalars(
        select(TinkerFuture)
        .where(
            TinkerFuture.status == PENDING,
            TinkerFuture.kind == "sample",
            TinkerFuture.run_id.is_(None),
            TinkerFuture.created_at < now - timedelta(seconds=wait_seconds),
        )
        .with_for_update(skip_locked=True)
    ).all()
    for future in futures:
        sampling = (future.request or {}).get("sampling") or {}
        base_model = sampling.get("base_model") or "its base model"
        waited = (as_utc(now) - as_utc(future.created_at)).total_seconds()
        fail_future(
            future,
            error=(
                f"no pool serving {base_model} claimed this sample request within {wait_seconds:g} s "
                f"(waited {waited:.0f} s); start a pool for that base model and sample again"
            ),
            now=now,
        )
    if futures:
        log.info("%s base-model sample request(s) failed: no pool claimed them in time", len(futures))
    return len(futures)
