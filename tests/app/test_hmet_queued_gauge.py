"""`loraloom_batches_queued{state="pending"}` counts only the batches a pool will still train: those of
queued and active runs. A deleted (or evicted, completed, failed) run keeps its pending batch rows
until the retention purge, and the pool never claims them (app/batches/claims.py claims only active
runs' batches), yet the gauge counted them as waiting. A lease a pool holds stays counted as
`claimed` whatever its run became. Both databases."""

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from app.main import create_app
from tests.app.api import TenantHandle, claim, create_run, new_tenant, post_batch, register, rewarded_batch
from tests.app.factories import Seeded
from tests.app.test_prometheus import scrape, value

MODEL = "loraloom-tiny"


@pytest.fixture
def uncached(settings: Settings) -> Iterator[TestClient]:
    """The service with every scrape reading the database (no reuse of the previous figures)."""
    with TestClient(create_app(settings.model_copy(update={"metrics_cache_seconds": 0.0}))) as client:
        yield client


def _batches(client: TestClient, tenant: TenantHandle, run_id: str, n: int) -> None:
    seeded = Seeded(tenant_id=tenant.id, secret=tenant.key, run_id=run_id)
    for _ in range(n):
        r = post_batch(client, seeded, rewarded_batch([1.0, 0.0], step=0))
        assert r.status_code == 201, r.text


def test_pending_counts_only_what_a_pool_will_still_train(uncached: TestClient) -> None:
    client = uncached
    tenant = new_tenant(client, quota=4)
    pool_id = register(client)
    kept = create_run(client, tenant, name="kept")["id"]
    deleted = create_run(client, tenant, name="deleted")["id"]
    _batches(client, tenant, kept, 2)
    _batches(client, tenant, deleted, 3)
    leased = claim(client, pool_id, max_batches=2)  # the oldest of each run (round-robin)
    assert {item["run_id"] for item in leased["batches"]} == {kept, deleted}, leased
    _, samples = scrape(client)
    assert value(samples, "loraloom_batches_queued", base_model=MODEL, state="pending") == 3
    assert value(samples, "loraloom_batches_queued", base_model=MODEL, state="claimed") == 2

    assert client.delete(f"/v1/runs/{deleted}", headers=tenant.headers).status_code == 200
    evicted = create_run(client, tenant, name="evicted")
    assert evicted["status"] == "active", evicted  # the deleted run's slot
    _batches(client, tenant, evicted["id"], 1)
    r = client.post(f"/v1/runs/{evicted['id']}/evict", json={"reason": "enough"}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    # The rows stay pending (until the purge), never to be claimed: 2 + 1 of them.
    rows = client.get(f"/v1/runs/{evicted['id']}/batches", headers=tenant.headers).json()["items"]
    assert [item["state"] for item in rows] == ["pending"]

    _, samples = scrape(client)
    assert value(samples, "loraloom_batches_queued", base_model=MODEL, state="pending") == 1  # kept's second
    # A lease is counted until acked or returned, the deleted run's included (the pool holds it).
    assert value(samples, "loraloom_batches_queued", base_model=MODEL, state="claimed") == 2
    # What the pool claims next agrees: the kept run's batch, nothing of the others.
    assert [item["run_id"] for item in claim(client, pool_id)["batches"]] == [kept]
