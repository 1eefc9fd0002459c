"""`POST /v1/pool/runs/deleted`: which of the runs a pool has files for it may remove (a deleted run's
checkpoints and saved weights on a pool with its own checkpoint directory; trainer_core.run_files).
Only deletions count: an evicted, completed or failed run keeps its checkpoints (init_from, an evicted
Tinker model), and a deleted run keeps them while a queued or active run starts from its checkpoint."""

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.adapters.models import Checkpoint
from app.config import Settings
from contracts.pool_api import MAX_DELETED_QUERY
from tests.app.api import WORKER_HEADERS, TenantHandle, create_run, new_tenant
from tests.app.factories import committed, end_read, make_run, make_tenant

ROUTE = "/v1/pool/runs/deleted"


def _deleted(client: TestClient, run_ids: list[str]) -> list[str]:
    r = client.post(ROUTE, json={"run_ids": run_ids}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    return r.json()["deleted"]


def test_only_deleted_and_unknown_runs_are_named(client: TestClient, db: Session) -> None:
    tenant = new_tenant(client, quota=4)
    active = create_run(client, tenant, name="active")["id"]
    evicted = create_run(client, tenant, name="evicted")["id"]
    deleted = create_run(client, tenant, name="deleted")["id"]
    r = client.post(f"/v1/runs/{evicted}/evict", json={"reason": "done"}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert client.delete(f"/v1/runs/{deleted}", headers=tenant.headers).status_code == 200
    owner, _ = make_tenant(db)
    completed = make_run(db, owner, status="completed").id
    failed = make_run(db, owner, status="failed").id
    end_read(db)
    unknown = "run_00000000beef"  # purged after its retention, or its tenant deleted

    asked = [active, evicted, deleted, completed, failed, unknown, deleted]  # a repeat is asked once
    assert _deleted(client, asked) == sorted([deleted, unknown])
    assert _deleted(client, [active, completed]) == []


def test_a_deleted_runs_checkpoint_an_init_from_needs_is_kept(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    tenant = new_tenant(client, quota=4)
    parent = create_run(client, tenant, name="parent")["id"]
    from_adapter = create_run(client, tenant, name="plain")["id"]
    with committed(settings) as session:
        session.add(Checkpoint(run_id=parent, step=4, total_samples=32))
    child = client.post(
        "/v1/runs",
        json={"name": "child", "init_from": {"run_id": parent, "checkpoint": 4, "with_optimizer": True}},
        headers=tenant.headers,
    )
    assert child.status_code == 201, child.text
    assert client.delete(f"/v1/runs/{parent}", headers=tenant.headers).status_code == 200
    assert client.delete(f"/v1/runs/{from_adapter}", headers=tenant.headers).status_code == 200

    # The child (not yet started, or started without a checkpoint of its own) still loads it.
    assert _deleted(client, [parent, from_adapter]) == [from_adapter]
    r = client.post(f"/v1/runs/{child.json()['id']}/evict", json={"reason": "x"}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert _deleted(client, [parent, from_adapter]) == sorted([parent, from_adapter])


def test_bad_questions_are_refused_naming_the_field(client: TestClient, tenant: TenantHandle) -> None:
    for body, loc in [
        ({"run_ids": []}, ["body", "run_ids"]),
        ({"run_ids": ["run_../../etc"]}, ["body", "run_ids", "0"]),
        ({"run_ids": ["run_0123456789AB"]}, ["body", "run_ids", "0"]),
        ({"run_ids": [f"run_{i:012x}" for i in range(MAX_DELETED_QUERY + 1)]}, ["body", "run_ids"]),
        ({"run_ids": ["run_0123456789ab"], "pool_id": "x"}, ["body", "pool_id"]),
    ]:
        r = client.post(ROUTE, json=body, headers=WORKER_HEADERS)
        assert r.status_code == 422, r.text
        assert [d["loc"] for d in r.json()["error"]["details"]] == [loc], r.text
    # Tenants never learn which runs exist: the route is the pool's.
    r = client.post(ROUTE, json={"run_ids": ["run_0123456789ab"]}, headers=tenant.headers)
    assert r.status_code == 403, r.text
    assert client.post(ROUTE, json={"run_ids": ["run_0123456789ab"]}).status_code == 401
