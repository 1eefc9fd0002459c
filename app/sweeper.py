"""Background sweeper: lease expiry, pool liveness, run heartbeats, Tinker futures that can no
longer be served (failed), done Tinker futures and expired dashboard sessions (purged).

Each sweep runs in a worker thread (the database calls block) with its own sessions; each
of its jobs commits on its own, so one failing never holds back the others, and no
failure ever stops the loop.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypeVar

from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from app.batches.leases import expire_leases
from app.config import Settings
from app.db import utcnow
from app.pools.service import declare_dead_pools
from app.runs.service import evict_silent_runs
from app.tinker.leases import fail_unclaimed_base_samples, fail_work_of_left_runs, purge_done_futures
from app.ui.sessions import purge_expired_sessions

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class SweepResult:
    expired_leases: int = 0
    """Batches whose lease ran out, returned to pending."""
    dead_pools: list[str] = field(default_factory=list)
    """Pools declared dead (their batches returned to pending)."""
    evicted_runs: list[str] = field(default_factory=list)
    """Runs evicted because their orchestrator stopped heartbeating."""
    failed_futures: int = 0
    """Pending or running Tinker futures failed: their run has left, or (base-model samples) no pool
    claimed them within settings.tinker_base_sample_wait_seconds."""
    purged_futures: int = 0
    """Done Tinker futures older than settings.tinker_future_ttl_seconds, deleted."""
    purged_ui_sessions: int = 0
    """Expired dashboard sessions deleted (at most app.ui.sessions.PURGE_BATCH a sweep)."""
    errors: list[str] = field(default_factory=list)
    """The jobs that failed (logged with their traceback)."""


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


def sweep_once(
    factory: sessionmaker[Session], *, settings: Settings, now: datetime | None = None
) -> SweepResult:
    """One pass: expired leases → pending; silent pools → dead (their batches → pending);
    runs whose orchestrator went silent → evicted; Tinker futures that can no longer be served →
    failed; Tinker futures done before the retention → deleted; expired dashboard sessions →
    deleted."""
    now = now or utcnow()
    result = SweepResult()
    result.expired_leases = _job(factory, "expire_leases", lambda s: expire_leases(s, now=now), result) or 0
    dead = _job(
        factory, "declare_dead_pools", lambda s: declare_dead_pools(s, now=now, settings=settings), result
    )
    result.dead_pools = dead or []
    evicted = _job(
        factory, "evict_silent_runs", lambda s: evict_silent_runs(s, now=now, settings=settings), result
    )
    result.evicted_runs = [run.id for run in evicted or []]
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
    ttl = settings.tinker_future_ttl_seconds
    purge = lambda s: purge_done_futures(s, now=now, ttl_seconds=ttl)  # noqa: E731
    result.purged_futures = _job(factory, "purge_tinker_futures", purge, result) or 0
    sessions = lambda s: purge_expired_sessions(s, now=now)  # noqa: E731
    result.purged_ui_sessions = _job(factory, "purge_ui_sessions", sessions, result) or 0
    return result


async def run_sweeper(app: FastAPI) -> None:
    """Sweep every settings.sweep_interval_seconds until cancelled (at shutdown)."""
    settings: Settings = app.state.settings
    factory: sessionmaker[Session] = app.state.session_factory
    while True:
        try:
            await asyncio.to_thread(sweep_once, factory, settings=settings)
        except Exception:  # sweep_once catches its jobs' errors; this is the last guard
            log.exception("sweeper: sweep failed")
        await asyncio.sleep(settings.sweep_interval_seconds)
