"""Concurrent requests against real Postgres through real HTTP (uvicorn, a thread per client):
no slot is ever given twice and no quota is ever exceeded. The guarantee comes from the
database (admission lock, tenant row lock, partial unique index), so it holds across API
replicas too."""

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import select

from app.main import create_app
from app.runs.models import Run
from tests.app.api import LiveServer, TenantHandle, new_tenant

pytestmark = pytest.mark.postgres_only

SLOTS = 4
QUOTAS = (1, 2, 3)  # together more than the slots, so both limits bind


def _in_parallel(n: int, fn: Callable[[int], httpx.Response]) -> list[httpx.Response]:
    barrier = threading.Barrier(n)

    def task(i: int) -> httpx.Response:
        barrier.wait()
        return fn(i)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(task, range(n)))


def _check_invariants(db, tenants: list[TenantHandle], quotas: dict[str, int]) -> list[Run]:
    db.rollback()  # a fresh snapshot
    runs = db.scalars(select(Run).where(Run.tenant_id.in_([t.id for t in tenants]))).all()
    active = [r for r in runs if r.status == "active"]
    slots = [r.slot for r in active]
    assert len(slots) == len(set(slots)), f"a slot was given twice: {sorted(slots)}"
    assert all(s is not None and 0 <= s < SLOTS for s in slots)
    per_tenant = Counter(r.tenant_id for r in active)
    for tenant_id, count in per_tenant.items():
        assert count <= quotas[tenant_id], f"quota exceeded for {tenant_id}: {count} > {quotas[tenant_id]}"
    # Work-conserving: a free slot never sits next to a queued run that fits its quota.
    if len(active) < SLOTS:
        fitting = [r for r in runs if r.status == "queued" and per_tenant[r.tenant_id] < quotas[r.tenant_id]]
        assert not fitting, "a slot is free but a queued run that fits waits"
    db.rollback()
    return runs


def test_concurrent_creates_and_evictions(settings, db):
    app_settings = settings.model_copy(update={"max_concurrent_runs": SLOTS})
    with (
        LiveServer(create_app(app_settings)) as server,
        httpx.Client(base_url=server.url, timeout=60) as admin,
    ):
        tenants = [new_tenant(admin, quota=q) for q in QUOTAS]
        quotas = {t.id: q for t, q in zip(tenants, QUOTAS, strict=True)}
        clients = [httpx.Client(base_url=server.url, timeout=60) for _ in range(20)]
        try:
            # 20 concurrent creates from 3 tenants.
            def create(i: int) -> httpx.Response:
                t = tenants[i % 3]
                return clients[i].post("/v1/runs", json={"name": f"c{i}"}, headers=t.headers)

            responses = _in_parallel(20, create)
            assert [r.status_code for r in responses] == [201] * 20, [
                r.text for r in responses if r.status_code != 201
            ]
            runs = _check_invariants(db, tenants, quotas)
            assert len(runs) == 20
            assert sum(r.status == "active" for r in runs) == SLOTS
            # What each response said agrees with the database.
            by_id = {r.id: r for r in runs}
            for r in responses:
                assert by_id[r.json()["id"]].status == r.json()["status"]

            # Evict every active run while 12 more creates race with the evictions.
            active = [r for r in runs if r.status == "active"]
            owner = {t.id: t for t in tenants}

            def evict_or_create(i: int) -> httpx.Response:
                if i < len(active):
                    run = active[i]
                    return clients[i].post(
                        f"/v1/runs/{run.id}/evict",
                        json={"reason": "race"},
                        headers=owner[run.tenant_id].headers,
                    )
                return clients[i].post("/v1/runs", json={"name": f"d{i}"}, headers=tenants[i % 3].headers)

            responses = _in_parallel(len(active) + 12, evict_or_create)
            assert all(r.status_code in (200, 201) for r in responses), [r.text for r in responses]
            runs = _check_invariants(db, tenants, quotas)
            assert sum(r.status == "active" for r in runs) == SLOTS
        finally:
            for c in clients:
                c.close()


def test_concurrent_idempotent_creates_make_one_run(settings, db, live_server):
    with httpx.Client(base_url=live_server.url, timeout=60) as admin:
        tenant = new_tenant(admin)
    headers = {**tenant.headers, "Idempotency-Key": "same-key"}

    def create(_: int) -> httpx.Response:
        with httpx.Client(base_url=live_server.url, timeout=60) as c:
            return c.post("/v1/runs", json={"name": "once", "config": {"max_steps": 3}}, headers=headers)

    responses = _in_parallel(8, create)
    assert sorted(r.status_code for r in responses) == [200] * 7 + [201]
    assert len({r.json()["id"] for r in responses}) == 1
    assert len(db.scalars(select(Run).where(Run.tenant_id == tenant.id)).all()) == 1
