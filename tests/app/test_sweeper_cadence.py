"""The sweeper's two cadences (app/sweeper.py): the liveness jobs at every sweep, the housekeeping
(purges, pruning, reconcile) at the first sweep, then every `housekeeping_interval_seconds`, and at
the next sweep again while it leaves a backlog."""

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from app import sweeper
from app.adapters.pruning import AdapterScan, AdaptersPruned
from app.adapters.reconcile import Reconciled, ReconcileScan
from app.batches.models import Batch
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.events.models import Event
from app.events.service import record_event
from app.main import create_app
from app.ui.sessions import PURGE_BATCH as UI_SESSIONS_PURGE_BATCH
from tests.app.factories import claimed_batch, committed, make_run, make_tenant

EVENT_RETENTION = 3_600.0


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def old_events(settings: Settings, n: int) -> str:
    """`n` events past EVENT_RETENTION and one newer (SQLite keeps the newest: app/retention.py);
    returns their run's id."""
    now = datetime.now(UTC)
    with committed(settings) as s:
        tenant, _ = make_tenant(s)
        run = make_run(s, tenant, status="active")
        for _ in range(n):
            record_event(s, action="test.old", actor="system", tenant_id=tenant.id, run_id=run.id)
    with committed(settings) as s:
        s.execute(
            update(Event)
            .where(Event.action == "test.old")
            .values(at=now - timedelta(seconds=EVENT_RETENTION + 60))
        )
        record_event(s, action="test.new", actor="system", tenant_id=tenant.id, run_id=run.id)
    return run.id


def count_old(factory: sessionmaker[Session]) -> int:
    with factory() as s:
        return s.scalar(select(func.count()).select_from(Event).where(Event.action == "test.old")) or 0


def test_the_clock_runs_the_first_sweep_then_every_interval_and_again_after_a_backlog() -> None:
    now = [100.0]
    clock = sweeper.HousekeepingClock(30.0, clock=lambda: now[0])
    assert clock.begin()  # the first sweep
    clock.ran(backlog=False)
    now[0] = 129.9
    assert not clock.begin()
    now[0] = 130.0  # 30 s after the last one began
    assert clock.begin()
    clock.ran(backlog=True)
    now[0] = 131.0
    assert clock.begin()  # the backlog goes on at the next sweep
    clock.ran(backlog=False)
    now[0] = 160.9
    assert not clock.begin()
    now[0] = 161.0
    assert clock.begin()


def test_a_sweep_without_housekeeping_runs_the_liveness_jobs_only(
    settings: Settings, factory: sessionmaker[Session]
) -> None:
    keep = settings.model_copy(update={"event_retention_seconds": EVENT_RETENTION})
    run_id = old_events(settings, 3)
    with factory() as s:
        pool_id = "pool_" + "0" * 12
        expired = claimed_batch(
            s, run_id=run_id, pool_id=pool_id, lease_expires_at=datetime.now(UTC) - timedelta(seconds=1)
        )

    liveness = sweeper.sweep_once(factory, settings=keep, housekeeping=False)
    assert liveness.errors == []
    assert liveness.expired_leases == 1  # leases are liveness
    assert not liveness.housekeeping and liveness.purged_events == 0
    assert count_old(factory) == 3
    with factory() as s:
        assert s.get_one(Batch, expired).state == "pending"

    full = sweeper.sweep_once(factory, settings=keep)
    assert full.errors == []
    assert full.housekeeping and full.purged_events == 3
    assert count_old(factory) == 0


def test_a_purge_stopped_at_its_bound_is_a_backlog(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    keep = settings.model_copy(update={"event_retention_seconds": EVENT_RETENTION})
    old_events(settings, 5)
    monkeypatch.setattr(sweeper, "MAX_PURGE_CHUNKS", 1)
    results = [sweeper.sweep_once(factory, settings=keep, purge_chunk=2)]
    while results[-1].housekeeping_backlog:
        results.append(sweeper.sweep_once(factory, settings=keep, purge_chunk=2))
        assert len(results) < 10
    assert [r.purged_events for r in results] == [2, 2, 1]
    assert [r.housekeeping_backlog for r in results] == [True, True, False]
    assert count_old(factory) == 0


def test_the_background_loop_follows_the_cadence(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first sweep housekeeps; it leaves a backlog, so the second does too; then none within
    the hour's interval."""
    fast = settings.model_copy(update={"sweep_interval_seconds": 0.01, "housekeeping_interval_seconds": 3600})
    calls: list[bool] = []
    enough = threading.Event()

    def recorded(*_args: Any, housekeeping: bool = True, **_kwargs: Any) -> sweeper.SweepResult:
        calls.append(housekeeping)
        if len(calls) >= 5:
            enough.set()
        return sweeper.SweepResult(housekeeping=housekeeping, housekeeping_backlog=len(calls) == 1)

    monkeypatch.setattr(sweeper, "sweep_once", recorded)
    with TestClient(create_app(fast)):
        assert enough.wait(30), calls
    assert calls[:5] == [True, True, False, False, False]


def test_what_is_a_backlog_and_what_is_not(
    settings: Settings, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job stopped at its bound with more to do is a backlog; a job that failed is not (retried at
    every sweep, it would only repeat its traceback every 2 s)."""

    def sweep(**fakes: Any) -> sweeper.SweepResult:
        with monkeypatch.context() as m:
            for name, fake in fakes.items():
                m.setattr(sweeper, name, fake)
            return sweeper.sweep_once(
                factory, settings=settings, adapter_scan=AdapterScan(), reconcile_scan=caught_up()
            )

    def caught_up() -> ReconcileScan:
        scan = ReconcileScan()
        scan.begin(datetime.now(UTC))
        for cursor in (scan.runs, scan.uploads, scan.trash):
            cursor.done = True
        return scan

    def failing(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("boom")

    quiet = sweep()
    assert quiet.errors == [] and quiet.housekeeping and not quiet.housekeeping_backlog

    more = AdaptersPruned(after_id=7, more=True)
    at_bound = sweep(prune_step_adapters=lambda *a, **k: more, MAX_PURGE_CHUNKS=2)
    assert at_bound.errors == [] and at_bound.housekeeping_backlog

    failed = sweep(prune_step_adapters=failing)
    assert failed.errors == ["prune_step_adapters"] and not failed.housekeeping_backlog

    mid_pass = sweep(reconcile_adapter_files=lambda *a, scan, **k: _unfinished(scan, failed=[]))
    assert mid_pass.errors == [] and mid_pass.housekeeping_backlog
    part_failed = sweep(reconcile_adapter_files=lambda *a, scan, **k: _unfinished(scan, failed=["trash"]))
    assert part_failed.errors == ["reconcile_adapter_files"] and not part_failed.housekeeping_backlog

    full_batch = sweep(purge_expired_sessions=lambda *a, **k: UI_SESSIONS_PURGE_BATCH)
    assert full_batch.errors == [] and full_batch.housekeeping_backlog


def _unfinished(scan: ReconcileScan, *, failed: list[str]) -> Reconciled:
    """A reconcile share that left the pass under way (its budget ran out, or a part failed)."""
    scan.trash.done = False
    return Reconciled(failed=failed)
