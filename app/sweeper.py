"""Background sweeper: lease expiry, pool liveness, run heartbeats, Tinker models whose session went
silent (evicted, app/tinker/abandoned.py), Tinker futures that can no longer be served (failed),
done Tinker futures, expired dashboard sessions, deleted runs and events past their retention
(purged), runs' step adapters past their newest
`settings.run_adapters_kept` (pruned, app/adapters/pruning.py), and adapter files no row refers to,
with trash a removal left (reconciled, a bounded share a sweep: app/adapters/reconcile.py).

Each sweep runs in a worker thread (the database calls block) with its own sessions; each
of its jobs commits on its own, so one failing never holds back the others, and no
failure ever stops the loop. The retention purges commit each chunk on its own (app/retention.py).

Two cadences: the liveness jobs (leases, pools, heartbeats, Tinker work that can no longer be
served: clients wait on them) at every sweep, `settings.sweep_interval_seconds`; the housekeeping
(purges, pruning, reconcile: deadlines of hours and days) at the first sweep, then every
`settings.housekeeping_interval_seconds`, and at the next sweep again while it leaves a backlog.
Each job costs a transaction or more even when it finds nothing (1-3 ms of CPU), so running the
housekeeping at every sweep was half of an idle service's CPU (docs/benchmarks.md).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import TypeVar

from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from app.adapters.pruning import AdapterScan, prune_step_adapters, remove_pruned_files
from app.adapters.reconcile import ReconcileScan, reconcile_adapter_files
from app.batches.leases import expire_leases
from app.config import Settings
from app.db import utcnow
from app.pools.service import declare_dead_pools
from app.retention import PURGE_CHUNK, purge_deleted_runs, purge_old_events
from app.runs.service import evict_silent_runs
from app.tinker.abandoned import evict_abandoned_models
from app.tinker.leases import fail_unclaimed_base_samples, fail_work_of_left_runs, purge_done_futures
from app.tinker.service import purge_finished_sessions
from app.ui.sessions import PURGE_BATCH as UI_SESSIONS_PURGE_BATCH
from app.ui.sessions import purge_expired_sessions

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_PURGE_CHUNKS = 20
"""Chunks a retention purge runs at most in one sweep: a backlog goes 20 x PURGE_CHUNK rows a sweep,
without holding the sweep's other jobs (lease expiry...) back for long."""


@dataclass
class SweepResult:
    expired_leases: int = 0
    """Batches whose lease ran out, returned to pending."""
    dead_pools: list[str] = field(default_factory=list)
    """Pools declared dead (their batches returned to pending)."""
    evicted_runs: list[str] = field(default_factory=list)
    """Runs evicted because their orchestrator stopped heartbeating."""
    evicted_tinker_runs: list[str] = field(default_factory=list)
    """Runs of Tinker models whose session stopped heartbeating (app/tinker/abandoned.py)."""
    failed_futures: int = 0
    """Pending or running Tinker futures failed: their run has left, or (base-model samples) no pool
    claimed them within settings.tinker_base_sample_wait_seconds."""
    purged_futures: int = 0
    """Done Tinker futures older than settings.tinker_future_ttl_seconds, deleted."""
    purged_ui_sessions: int = 0
    """Expired dashboard sessions deleted (at most app.ui.sessions.PURGE_BATCH a sweep)."""
    purged_runs: list[str] = field(default_factory=list)
    """Runs deleted more than settings.deleted_run_retention_seconds ago, gone with every row about them."""
    purged_run_rows: int = 0
    """Rows deleted by the purge of those runs (theirs included, and those of runs it has begun)."""
    purged_events: int = 0
    """Events older than settings.event_retention_seconds, deleted."""
    purged_tinker_sessions: int = 0
    """Tinker sessions finished (or silent) over settings.tinker_session_retention_seconds ago and
    owning no model, deleted."""
    purged_sampling_sessions: int = 0
    """Tinker sampling sessions of runs that left, over the same retention, deleted."""
    pruned_adapters: int = 0
    """Step adapters (rows) past their run's newest settings.run_adapters_kept, deleted."""
    pruned_adapter_files: int = 0
    """Their files (step directories and cached archives) removed, with any left without a row."""
    reconciled_run_files: int = 0
    """Runs' step directories and cached archives no row refers to (a crash between a commit and the
    files' removal, or their move into place and the commit), and staging leftovers, removed."""
    reconciled_uploads: int = 0
    """Uploaded adapters' directories no row names, and upload staging leftovers, removed."""
    emptied_trash_entries: int = 0
    """Entries of runs/.trash a removal cut short left, deleted."""
    errors: list[str] = field(default_factory=list)
    """The jobs that failed (logged with their traceback)."""
    housekeeping: bool = False
    """Whether this sweep ran the housekeeping jobs (from `purged_futures` on)."""
    housekeeping_backlog: bool = False
    """Housekeeping stopped at its per-sweep bound with more to do (a purge's MAX_PURGE_CHUNKS, the
    dashboard sessions' batch, the adapter scan's chunks, the reconcile pass's time budget): the
    background loop runs it again at the next sweep. A job that failed is no backlog."""


def _job(
    factory: sessionmaker[Session], name: str, work: Callable[[Session], T], result: SweepResult
) -> T | None:
    try:
        with factory() as session:
            out = work(session)
            session.commit()
            return out
    except Exception:
        log.exception("sweeper: %s failed", name)
        result.errors.append(name)
        return None


def _chunks(
    factory: sessionmaker[Session],
    name: str,
    chunk: Callable[[Session], T],
    more: Callable[[T], bool],
    result: SweepResult,
) -> list[T]:
    """Run `chunk` as a job, each call its own transaction, while `more` says there may be more, at
    most MAX_PURGE_CHUNKS times; stops at a failure (logged and named in `result`, as any job's).
    Stopping at the bound with more to do marks `result.housekeeping_backlog`."""
    done: list[T] = []
    for _ in range(MAX_PURGE_CHUNKS):
        out = _job(factory, name, chunk, result)
        if out is None:
            break
        done.append(out)
        if not more(out):
            break
    else:
        result.housekeeping_backlog = True
    return done


def sweep_once(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    now: datetime | None = None,
    purge_chunk: int = PURGE_CHUNK,
    adapter_scan: AdapterScan | None = None,
    reconcile_scan: ReconcileScan | None = None,
    listening_since: datetime | None = None,
    housekeeping: bool = True,
) -> SweepResult:
    """One pass: expired leases → pending; silent pools → dead (their batches → pending);
    runs whose orchestrator went silent → evicted; Tinker models whose session went silent →
    evicted; Tinker futures that can no longer be served → failed; Tinker futures done before the
    retention → deleted; expired dashboard sessions → deleted; runs deleted before their retention
    → deleted with every row about them; events older than theirs → deleted; finished Tinker
    sessions and sampling sessions of runs that left, after theirs → deleted (`purge_chunk` rows a
    transaction); step adapters past their run's newest kept → deleted, rows then files
    (`adapter_scan`: where the last sweep left the adapters; None reads them all); adapter files no
    row refers to, and stale trash → deleted (`reconcile_scan`: where the pass stands; None begins
    one). `listening_since`: when this process's sweeper started; a heartbeat timeout (a run's, a
    Tinker session's) counts from there at the earliest, as none could land while the service was
    down. `housekeeping` False: the liveness jobs only, up to the failing of Tinker work (the
    background loop's cadence, in the module's docstring)."""
    now = now or utcnow()
    result = SweepResult()
    result.expired_leases = _job(factory, "expire_leases", lambda s: expire_leases(s, now=now), result) or 0
    dead = _job(
        factory, "declare_dead_pools", lambda s: declare_dead_pools(s, now=now, settings=settings), result
    )
    result.dead_pools = dead or []
    evicted = _job(
        factory,
        "evict_silent_runs",
        lambda s: evict_silent_runs(s, now=now, settings=settings, listening_since=listening_since),
        result,
    )
    result.evicted_runs = [run.id for run in evicted or []]
    abandoned = partial(
        evict_abandoned_models,
        now=now,
        timeout_seconds=settings.tinker_session_timeout_seconds,
        settings=settings,
        listening_since=listening_since,
    )
    evicted_tinker = _job(factory, "evict_abandoned_models", abandoned, result)
    result.evicted_tinker_runs = [run.id for run in evicted_tinker or []]
    # After the evictions, so that the work of a run evicted in this sweep fails in it too.
    wait = settings.tinker_base_sample_wait_seconds
    left = _job(
        factory, "fail_tinker_work_of_left_runs", lambda s: fail_work_of_left_runs(s, now=now), result
    )
    unclaimed = _job(
        factory,
        "fail_unclaimed_base_samples",
        lambda s: fail_unclaimed_base_samples(s, now=now, wait_seconds=wait),
        result,
    )
    result.failed_futures = (left or 0) + (unclaimed or 0)
    if not housekeeping:
        return result
    result.housekeeping = True
    ttl = settings.tinker_future_ttl_seconds
    purge = lambda s: purge_done_futures(s, now=now, ttl_seconds=ttl)  # noqa: E731
    result.purged_futures = _job(factory, "purge_tinker_futures", purge, result) or 0
    sessions = lambda s: purge_expired_sessions(s, now=now)  # noqa: E731
    result.purged_ui_sessions = _job(factory, "purge_ui_sessions", sessions, result) or 0
    if result.purged_ui_sessions >= UI_SESSIONS_PURGE_BATCH:  # one batch a call: there may be more
        result.housekeeping_backlog = True
    keep_runs, keep_events = settings.deleted_run_retention_seconds, settings.event_retention_seconds
    runs = _chunks(
        factory,
        "purge_deleted_runs",
        lambda s: purge_deleted_runs(s, now=now, retention_seconds=keep_runs, chunk=purge_chunk),
        lambda out: out.more,
        result,
    )
    result.purged_runs = [run_id for out in runs for run_id in out.runs]
    result.purged_run_rows = sum(out.rows for out in runs)
    events = _chunks(
        factory,
        "purge_events",
        lambda s: purge_old_events(s, now=now, retention_seconds=keep_events, chunk=purge_chunk),
        lambda purged: purged == purge_chunk,
        result,
    )
    result.purged_events = sum(events)
    # After the runs' purge: a purged run's model no longer holds its Tinker session back.
    keep_sessions = settings.tinker_session_retention_seconds
    tinker_sessions = _chunks(
        factory,
        "purge_tinker_sessions",
        lambda s: purge_finished_sessions(s, now=now, retention_seconds=keep_sessions, chunk=purge_chunk),
        lambda out: out.more,
        result,
    )
    result.purged_tinker_sessions = sum(out.sessions for out in tinker_sessions)
    result.purged_sampling_sessions = sum(out.sampling_sessions for out in tinker_sessions)
    _prune_adapters(
        factory,
        settings=settings,
        now=now,
        scan=adapter_scan or AdapterScan(),
        chunk=purge_chunk,
        result=result,
    )
    # After the pruning: what it removed itself is not looked at again.
    _reconcile(factory, settings=settings, now=now, scan=reconcile_scan or ReconcileScan(), result=result)
    return result


def _prune_adapters(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    now: datetime,
    scan: AdapterScan,
    chunk: int,
    result: SweepResult,
) -> None:
    """Chunks of `prune_step_adapters` as `_chunks` runs them, each followed, once committed, by the
    removal of its runs' files (each run its own transaction, under its row lock). The scan moves on
    only past a committed chunk: a failed one is read again by the next housekeeping (a failure is
    no backlog: retried at every sweep, it would only repeat its traceback)."""
    scan.begin(now)
    for _ in range(MAX_PURGE_CHUNKS):
        prune = partial(
            prune_step_adapters, kept=settings.run_adapters_kept, after_id=scan.after_id, chunk=chunk
        )
        out = _job(factory, "prune_step_adapters", prune, result)
        if out is None:
            return
        scan.after_id = out.after_id
        result.pruned_adapters += out.rows
        for run_id in out.runs:
            files = partial(remove_pruned_files, run_id=run_id, settings=settings)
            result.pruned_adapter_files += _job(factory, "remove_pruned_adapter_files", files, result) or 0
        if not out.more:
            scan.caught_up = True
            return
    result.housekeeping_backlog = True  # stopped at the bound with more to read


def _reconcile(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    now: datetime,
    scan: ReconcileScan,
    result: SweepResult,
) -> None:
    """This sweep's share of the reconcile pass (its own short transactions, within
    reconcile.BUDGET_SECONDS); a failure is logged and named in `result`, as any job's."""
    name = "reconcile_adapter_files"
    try:
        done = reconcile_adapter_files(factory, settings=settings, scan=scan, now=now)
    except Exception:
        log.exception("sweeper: %s failed", name)
        result.errors.append(name)
        return
    result.reconciled_run_files = done.run_files
    result.reconciled_uploads = done.uploads
    result.emptied_trash_entries = done.trash_entries
    if done.failed:
        result.errors.append(name)
    elif not scan.caught_up:  # the sweep's budget ran out mid-pass
        result.housekeeping_backlog = True


class HousekeepingClock:
    """Whether the background loop's next sweep runs the housekeeping jobs: the first sweep, then
    once `interval_s` has passed since the last one began, and at once while it leaves a backlog."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next: float | None = None  # None: due (nothing ran yet, or a backlog is left)
        self._began = 0.0

    def begin(self) -> bool:
        """Whether the sweep beginning now runs the housekeeping."""
        self._began = self._clock()
        return self._next is None or self._began >= self._next

    def ran(self, *, backlog: bool) -> None:
        """The sweep begun last ran the housekeeping, and left a backlog or not."""
        self._next = None if backlog else self._began + self.interval_s


async def run_sweeper(app: FastAPI) -> None:
    """Sweep every settings.sweep_interval_seconds until cancelled (at shutdown), with the
    housekeeping on the cadence of `HousekeepingClock`."""
    settings: Settings = app.state.settings
    factory: sessionmaker[Session] = app.state.session_factory
    scan, reconcile = AdapterScan(), ReconcileScan()
    clock = HousekeepingClock(settings.housekeeping_interval_seconds)
    listening_since = utcnow()
    while True:
        housekeeping = clock.begin()
        try:
            result = await asyncio.to_thread(
                sweep_once,
                factory,
                settings=settings,
                adapter_scan=scan,
                reconcile_scan=reconcile,
                listening_since=listening_since,
                housekeeping=housekeeping,
            )
        except Exception:  # sweep_once catches its jobs' errors; this is the last guard
            log.exception("sweeper: sweep failed")
        else:
            if housekeeping:
                clock.ran(backlog=result.housekeeping_backlog)
        await asyncio.sleep(settings.sweep_interval_seconds)
