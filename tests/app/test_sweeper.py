"""The background sweeper: lease expiry, dead pools, silent runs; errors never stop it."""

import time
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app import sweeper
from app.batches.models import Batch
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.main import create_app
from app.pools.models import Pool
from app.runs.models import Run
from tests.app.api import WORKER_HEADERS, TenantHandle, create_run, new_tenant, register
from tests.app.factories import claimed_batch, end_read


@pytest.fixture
def factory(settings: Settings):
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def test_sweep_once(
    client: TestClient, tenant: TenantHandle, db: Session, settings: Settings, factory
) -> None:
    pool_id = register(client)
    other_pool = register(client, base_model="other-model")
    run = create_run(client, tenant, heartbeat_timeout=30)
    quiet = create_run(client, tenant, name="no-timeout")
    now = datetime.now(UTC)
    leased_by_dead = claimed_batch(
        db, run_id=run["id"], pool_id=pool_id, lease_expires_at=now + timedelta(hours=2)
    )
    expired = claimed_batch(
        db, run_id=quiet["id"], pool_id=other_pool, lease_expires_at=now - timedelta(seconds=1)
    )

    # Now: only the expired lease goes back; pools and runs are within their timeouts.
    result = sweeper.sweep_once(factory, settings=settings, now=now)
    assert result.errors == []
    assert (result.expired_leases, result.dead_pools, result.evicted_runs) == (1, [], [])
    db.expire_all()
    assert db.get_one(Batch, expired).state == "pending"
    assert db.get_one(Batch, leased_by_dead).state == "claimed"
    end_read(db)

    # A minute on: the other pool heartbeats, the first does not; the run's orchestrator is silent.
    later = now + timedelta(seconds=settings.pool_timeout_seconds + 1)
    assert (
        client.post("/v1/pool/heartbeat", json={"pool_id": other_pool}, headers=WORKER_HEADERS).status_code
        == 200
    )
    with factory() as s:  # the heartbeat above stamped the real clock; move it to `later`
        s.get_one(Pool, other_pool).last_heartbeat_at = later
        s.commit()
    result = sweeper.sweep_once(factory, settings=settings, now=later)
    assert result.errors == []
    assert result.dead_pools == [pool_id]
    assert result.evicted_runs == [run["id"]]
    db.expire_all()
    assert db.get_one(Pool, pool_id).status == "dead"
    assert db.get_one(Pool, other_pool).status == "alive"
    batch = db.get_one(Batch, leased_by_dead)
    assert (batch.state, batch.pool_id) == ("pending", None)
    evicted = db.get_one(Run, run["id"])
    assert (evicted.status, evicted.evicted_by) == ("evicted", "heartbeat")
    assert db.get_one(Run, quiet["id"]).status == "active"


def test_a_failing_job_does_not_stop_the_others(
    client: TestClient, settings: Settings, factory, monkeypatch, caplog
) -> None:
    pool_id = register(client)

    def broken(session, *, now):
        raise RuntimeError("boom")

    monkeypatch.setattr(sweeper, "expire_leases", broken)
    later = datetime.now(UTC) + timedelta(seconds=settings.pool_timeout_seconds + 1)
    result = sweeper.sweep_once(factory, settings=settings, now=later)
    assert result.errors == ["expire_leases"]
    assert result.dead_pools == [pool_id]
    assert "sweeper: expire_leases failed" in caplog.text


def test_background_loop_declares_a_silent_pool_dead(settings: Settings, monkeypatch) -> None:
    # The default pool timeout outlasts any set-up below: the pool falls silent only when the test
    # dates its last heartbeat back, once its claimed batch is in (a batch inserted after the pool
    # was already declared dead would never be returned).
    fast = settings.model_copy(update={"sweep_interval_seconds": 0.05})
    real = sweeper.sweep_once
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("first sweep fails")  # the loop must survive it
        return real(*args, **kwargs)

    monkeypatch.setattr(sweeper, "sweep_once", flaky)
    with TestClient(create_app(fast)) as client:
        tenant = new_tenant(client)
        pool_id = register(client)
        run = create_run(client, tenant)
        engine = make_engine(fast.database_url)
        with make_session_factory(engine)() as db:
            batch_id = claimed_batch(
                db, run_id=run["id"], pool_id=pool_id, lease_expires_at=datetime.now(UTC) + timedelta(hours=1)
            )
            db.get_one(Pool, pool_id).last_heartbeat_at = datetime.now(UTC) - timedelta(hours=1)
            db.commit()
        deadline = time.monotonic() + 30
        status = 200
        while time.monotonic() < deadline:
            status = client.get(
                "/v1/pool/state", params={"pool_id": pool_id}, headers=WORKER_HEADERS
            ).status_code
            if status == 409:
                break
            time.sleep(0.1)
        assert status == 409, "the sweeper never declared the silent pool dead"
        with make_session_factory(engine)() as db:
            assert db.get_one(Batch, batch_id).state == "pending"
        engine.dispose()
    assert calls["n"] >= 2
