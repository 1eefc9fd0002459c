"""Pool registration, heartbeats, state, dead pools, and admission against a pool's capabilities."""

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.batches.models import Batch
from app.config import Settings
from app.main import create_app
from app.pools.models import Pool
from app.pools.service import declare_dead_pools
from app.runs.admission import admission_problems, live_pool_slots
from tests.app.api import (
    ADMIN_HEADERS,
    POOL_SPEC,
    WORKER_HEADERS,
    TenantHandle,
    batch_body,
    create_run,
    new_tenant,
    register,
)
from tests.app.factories import claimed_batch, end_read, run_row


def test_register_heartbeat_and_state(client: TestClient, tenant: TenantHandle, settings: Settings) -> None:
    mine = create_run(client, tenant, name="a", max_steps=3)
    other_model = create_run(client, tenant, name="b", base_model="some-other-model")

    r = client.post("/v1/pool/register", json=POOL_SPEC, headers=WORKER_HEADERS)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["pool_id"].startswith("pool_")
    assert body["lease_seconds"] == settings.lease_seconds
    assert 0 < body["heartbeat_interval_s"] < settings.pool_timeout_seconds

    r = client.post("/v1/pool/heartbeat", json={"pool_id": body["pool_id"]}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "alive"}

    r = client.get("/v1/pool/state", params={"pool_id": body["pool_id"]}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    runs = r.json()["runs"]
    # Only the pool's base model; the other model's run waits for its own pool.
    assert [x["run_id"] for x in runs] == [mine["id"]]
    assert runs[0]["slot"] == 0
    assert runs[0]["status"] == "active"
    assert runs[0]["config"]["max_steps"] == 3
    assert runs[0]["progress"] == {"step": 0, "total_tokens": 0, "total_samples": 0}
    assert client.get(f"/v1/runs/{other_model['id']}", headers=tenant.headers).json()["status"] == "active"


def test_register_validates_its_body(client: TestClient) -> None:
    r = client.post(
        "/v1/pool/register", json=POOL_SPEC | {"slots": 0, "max_rank": "x"}, headers=WORKER_HEADERS
    )
    assert r.status_code == 422
    fields = {tuple(p["loc"]) for p in r.json()["error"]["details"]}
    assert ("body", "slots") in fields and ("body", "max_rank") in fields
    bad = {k: v for k, v in POOL_SPEC.items() if k != "max_seq_len"}
    assert client.post("/v1/pool/register", json=bad, headers=WORKER_HEADERS).status_code == 422


def test_unknown_pool(client: TestClient) -> None:
    r = client.post("/v1/pool/heartbeat", json={"pool_id": "pool_000000000000"}, headers=WORKER_HEADERS)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "pool_not_found"
    assert (
        client.get(
            "/v1/pool/state", params={"pool_id": "pool_000000000000"}, headers=WORKER_HEADERS
        ).status_code
        == 404
    )


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/pool/register", POOL_SPEC),
        ("POST", "/v1/pool/heartbeat", {"pool_id": "pool_000000000000"}),
        ("GET", "/v1/pool/state?pool_id=pool_000000000000", None),
        ("POST", "/v1/pool/deregister", {"pool_id": "pool_000000000000"}),
        ("PUT", "/v1/pool/runs/run_000000000000/adapters/1", None),
        ("POST", "/v1/pool/runs/run_000000000000/steps", {"step": 1, "total_tokens": 1, "total_samples": 1}),
        ("POST", "/v1/pool/runs/run_000000000000/checkpoints", {"step": 1, "total_samples": 1}),
        ("POST", "/v1/pool/runs/run_000000000000/evict", {"reason": "x"}),
    ],
)
def test_pool_routes_refuse_tenant_keys(
    client: TestClient, tenant: TenantHandle, method: str, path: str, body: dict | None
) -> None:
    # A valid tenant key is a known caller on the wrong route (403); no key or an unknown one, 401.
    cases = [
        (tenant.headers, 403, "forbidden"),
        (ADMIN_HEADERS, 403, "forbidden"),
        ({}, 401, "unauthorized"),
        ({"Authorization": "Bearer llk_not-a-key"}, 401, "unauthorized"),
    ]
    for headers, status, code in cases:
        r = client.request(method, path, json=body, headers=headers)
        assert r.status_code == status, (headers, r.text)
        assert r.json()["error"]["code"] == code


def test_pool_slots_become_the_slot_count(client: TestClient, settings: Settings, db: Session) -> None:
    assert settings.max_concurrent_runs == 2
    tenant = new_tenant(client, quota=5)
    runs = [create_run(client, tenant, name=f"r{i}") for i in range(4)]
    assert [r["status"] for r in runs] == ["active", "active", "queued", "queued"]
    assert live_pool_slots(db, base_model="loraloom-tiny") is None
    end_read(db)

    register(client, slots=3)
    assert live_pool_slots(db, base_model="loraloom-tiny") == 3
    # The new slot went to the oldest queued run at registration.
    statuses = [run_row(db, r["id"]).status for r in runs]
    assert statuses == ["active", "active", "active", "queued"]
    assert run_row(db, runs[2]["id"]).slot == 2
    # And admission keeps using the pool's count for new runs.
    assert create_run(client, tenant, name="r4")["status"] == "queued"


def test_runs_the_pool_cannot_train_fail_with_a_reason(
    client: TestClient, settings: Settings, db: Session
) -> None:
    tenant = new_tenant(client, quota=8)
    too_big = create_run(client, tenant, name="rank", lora={"rank": 32})  # active (slot 0)
    modules = create_run(client, tenant, name="modules", lora={"target_modules": ["q_proj", "gate_proj"]})
    too_long = create_run(client, tenant, name="seq", seq_len=4096)  # queued
    fine = create_run(client, tenant, name="fine", lora={"rank": 16, "target_modules": ["q_proj", "v_proj"]})
    waits = create_run(client, tenant, name="other", base_model="other-model", lora={"rank": 64})
    assert [r["status"] for r in (too_big, modules, too_long, fine)] == [
        "active",
        "active",
        "queued",
        "queued",
    ]

    pool_id = register(client)

    expected = {
        too_big["id"]: "lora.rank 32 exceeds the pool's max_rank 16",
        modules["id"]: "lora.target_modules ['gate_proj'] are not adapted by the pool",
        too_long["id"]: "seq_len 4096 exceeds the pool's max_seq_len 1024",
    }
    for run_id, why in expected.items():
        r = client.get(f"/v1/runs/{run_id}", headers=tenant.headers).json()
        assert r["status"] == "failed", r
        assert why in r["failure_reason"]
        assert pool_id in r["failure_reason"]
        error_file = settings.runs_dir / run_id / "control" / "config_validation_error.txt"
        assert why in error_file.read_text()
    # The trainable run got a freed slot; a run whose base model has no pool is left alone.
    assert client.get(f"/v1/runs/{fine['id']}", headers=tenant.headers).json()["status"] == "active"
    assert client.get(f"/v1/runs/{waits['id']}", headers=tenant.headers).json()["status"] == "active"
    state = client.get("/v1/pool/state", params={"pool_id": pool_id}, headers=WORKER_HEADERS).json()
    assert [x["run_id"] for x in state["runs"]] == [fine["id"]]


def test_pool_capability_problems_for_admission(client: TestClient, db: Session) -> None:
    config = {"base_model": "loraloom-tiny", "lora": {"rank": 64}, "seq_len": 2048}
    assert admission_problems(db, config=config) == []  # no pool yet: the run waits
    end_read(db)
    register(client)
    db.expire_all()
    problems = admission_problems(db, config=config)
    assert len(problems) == 2
    assert "max_rank 16" in problems[0] and "max_seq_len 1024" in problems[1]
    assert admission_problems(db, config={"base_model": "loraloom-tiny"}) == []


def test_state_fails_an_untrainable_active_run(client: TestClient, tenant: TenantHandle, db: Session) -> None:
    """A run that slipped past admission (e.g. created while the pool registered) never reaches
    the trainer: the state poll fails it."""
    pool_id = register(client)
    run = create_run(client, tenant, name="ok")
    # Simulate the race directly: the config changes under an active run.
    row = run_row(db, run["id"])
    row.config = row.config | {"lora": row.config["lora"] | {"rank": 128}}
    db.commit()
    r = client.get("/v1/pool/state", params={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert r.status_code == 200
    assert r.json()["runs"] == []
    assert run_row(db, run["id"]).status == "failed"


def test_a_run_the_live_pool_cannot_train_is_refused_at_creation(
    client: TestClient, tenant: TenantHandle
) -> None:
    """Even with every slot taken: it would never be trained, so it is a 422 naming each field and
    the pool's limit, and nothing is stored."""
    register(client, slots=1)
    assert create_run(client, tenant, name="fits")["status"] == "active"
    body = {
        "name": "too-big",
        "config": {"lora": {"rank": 64, "target_modules": ["q_proj", "gate_proj"]}, "seq_len": 2048},
    }
    r = client.post("/v1/runs", json=body, headers=tenant.headers)
    assert r.status_code == 422, r.text
    details = r.json()["error"]["details"]
    assert [(".".join(d["loc"]), d["limit"]) for d in details] == [
        ("body.config.lora.rank", 16),
        ("body.config.lora.target_modules", ["k_proj", "o_proj", "q_proj", "v_proj"]),
        ("body.config.seq_len", 1024),
    ]
    assert len(client.get("/v1/runs", headers=tenant.headers).json()["items"]) == 1
    assert create_run(client, tenant, name="waits")["status"] == "queued"


def test_admission_fails_a_queued_run_the_pool_cannot_train(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    """The capability check runs again when a slot is handed out, so nothing untrainable gets one."""
    pool_id = register(client, slots=1)
    first = create_run(client, tenant, name="first")
    waiting = create_run(client, tenant, name="waiting")
    assert waiting["status"] == "queued"
    row = run_row(db, waiting["id"])  # its config changes while it waits (as in the state test)
    row.config = row.config | {"lora": row.config["lora"] | {"rank": 128}}
    db.commit()

    r = client.post(f"/v1/runs/{first['id']}/evict", json={"reason": "done"}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    got = client.get(f"/v1/runs/{waiting['id']}", headers=tenant.headers).json()
    assert got["status"] == "failed" and got["slot"] is None
    assert pool_id in got["failure_reason"] and "lora.rank 128 exceeds" in got["failure_reason"]


def test_heartbeat_extends_the_pools_leases(
    client: TestClient, tenant: TenantHandle, db: Session, settings
) -> None:
    pool_id = register(client)
    run = create_run(client, tenant)
    # Well short of lease_seconds (120), so the extension shows, and far enough that the app's own
    # sweeper cannot expire it first on a slow machine (1 s did, in CI under load: lease None).
    soon = datetime.now(UTC) + timedelta(seconds=30)
    batch_id = claimed_batch(db, run_id=run["id"], pool_id=pool_id, lease_expires_at=soon)
    before = datetime.now(UTC)
    assert (
        client.post("/v1/pool/heartbeat", json={"pool_id": pool_id}, headers=WORKER_HEADERS).status_code
        == 200
    )
    db.expire_all()
    lease = db.get_one(Batch, batch_id).lease_expires_at
    assert lease is not None
    lease = lease if lease.tzinfo else lease.replace(tzinfo=UTC)
    assert lease >= before + timedelta(seconds=settings.lease_seconds - 1)
    pool = db.get_one(Pool, pool_id)
    assert pool.status == "alive"


def test_dead_pool(client: TestClient, tenant: TenantHandle, db: Session, settings: Settings) -> None:
    pool_id = register(client)
    run = create_run(client, tenant)
    far = datetime.now(UTC) + timedelta(hours=1)
    batch_id = claimed_batch(db, run_id=run["id"], pool_id=pool_id, lease_expires_at=far)

    # Not silent long enough yet.
    assert declare_dead_pools(db, now=datetime.now(UTC), settings=settings) == []
    later = datetime.now(UTC) + timedelta(seconds=settings.pool_timeout_seconds + 1)
    assert declare_dead_pools(db, now=later, settings=settings) == [pool_id]
    db.commit()

    db.expire_all()
    assert db.get_one(Pool, pool_id).status == "dead"
    batch = db.get_one(Batch, batch_id)
    assert (batch.state, batch.pool_id, batch.lease_expires_at) == ("pending", None, None)
    end_read(db)

    r = client.post("/v1/pool/heartbeat", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "pool_dead"
    assert (
        client.get("/v1/pool/state", params={"pool_id": pool_id}, headers=WORKER_HEADERS).status_code == 409
    )
    # Its runs wait (still active) for the next pool, which takes over the base model.
    assert live_pool_slots(db, base_model="loraloom-tiny") is None
    end_read(db)
    assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["status"] == "active"
    new_pool = register(client)
    state = client.get("/v1/pool/state", params={"pool_id": new_pool}, headers=WORKER_HEADERS).json()
    assert [x["run_id"] for x in state["runs"]] == [run["id"]]


def test_reregistration_replaces_the_previous_pool(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    old = register(client)
    run = create_run(client, tenant)
    far = datetime.now(UTC) + timedelta(hours=1)
    batch_id = claimed_batch(db, run_id=run["id"], pool_id=old, lease_expires_at=far)
    other_model = register(client, base_model="other-model")

    new = register(client)  # the same base model: a restarted pool
    db.expire_all()
    assert db.get_one(Pool, old).status == "stopped"
    assert db.get_one(Pool, other_model).status == "alive"
    assert db.get_one(Batch, batch_id).state == "pending"
    end_read(db)
    r = client.post("/v1/pool/heartbeat", json={"pool_id": old}, headers=WORKER_HEADERS)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "pool_stopped"
    assert client.post("/v1/pool/heartbeat", json={"pool_id": new}, headers=WORKER_HEADERS).json() == {
        "status": "alive"
    }
    alive = db.scalars(
        select(Pool.id).where(Pool.base_model == "loraloom-tiny", Pool.status == "alive")
    ).all()
    assert alive == [new]
    # The registration says whom it replaced (the pool logs it as a warning); none for a new model.
    end_read(db)
    third = client.post("/v1/pool/register", json=POOL_SPEC, headers=WORKER_HEADERS).json()
    assert third["replaced"] == [new]
    assert (
        client.post(
            "/v1/pool/register", json={**POOL_SPEC, "base_model": "fresh-model"}, headers=WORKER_HEADERS
        ).json()["replaced"]
        == []
    )


def test_tenants_see_what_the_live_pools_can_train(client: TestClient, tenant: TenantHandle) -> None:
    assert client.get("/v1/pools", headers=tenant.headers).json() == {"items": []}
    register(client, slots=2)
    create_run(client, tenant, name="one")
    r = client.get("/v1/pools", headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert r.json()["items"] == [
        {
            "base_model": "loraloom-tiny",
            "vocab_size": 256,
            "max_rank": 16,
            "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"],
            "seq_len": 1024,
            "slots": 2,
            "slots_used": 1,
            "slots_free": 1,
        }
    ]
    assert client.get("/v1/pools").status_code == 401
    assert client.get("/v1/pools", headers=WORKER_HEADERS).status_code == 401  # a tenant route


def test_runs_wait_for_a_pool_when_configured(settings: Settings) -> None:
    """runs_wait_for_pool: a run for a base model no live pool serves is queued with the reason,
    takes no batch (so none is stored unchecked against the vocabulary) and is admitted when a
    pool registers; then token ids are checked against the pool's vocabulary."""
    waiting = settings.model_copy(update={"runs_wait_for_pool": True})
    with TestClient(create_app(waiting)) as client:
        tenant = new_tenant(client)
        run = create_run(client, tenant)
        assert run["status"] == "queued"
        got = client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()
        assert got["waiting_reason"] == "waiting for a pool that serves 'loraloom-tiny'"
        url = f"/v1/runs/{run['id']}/batches"
        r = client.post(url, json=batch_body(), headers=tenant.headers)
        assert r.status_code == 409 and r.json()["error"]["code"] == "run_not_active"
        register(client)
        got = client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()
        assert (got["status"], got["waiting_reason"]) == ("active", None)
        too_big = batch_body()
        too_big["examples"][0]["completion_ids"][0] = 256  # the pool's vocab_size is 256
        r = client.post(url, json=too_big, headers=tenant.headers)
        assert r.status_code == 422, r.text
        assert client.post(url, json=batch_body(), headers=tenant.headers).status_code == 201


def test_deregister_returns_the_pools_leases_at_once(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    """A pool stopping (Ctrl-C) deregisters: its batches are pending now, not after the pool timeout."""
    pool_id = register(client)
    run = create_run(client, tenant)
    far = datetime.now(UTC) + timedelta(hours=1)
    batch_id = claimed_batch(db, run_id=run["id"], pool_id=pool_id, lease_expires_at=far)
    end_read(db)

    r = client.post("/v1/pool/deregister", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "stopped"}
    db.expire_all()
    batch = db.get_one(Batch, batch_id)
    assert (batch.state, batch.pool_id, batch.lease_expires_at) == ("pending", None, None)
    assert db.get_one(Pool, pool_id).status == "stopped"
    end_read(db)
    # Idempotent; the stopped pool must register again to train; the run waits for the next pool.
    again = client.post("/v1/pool/deregister", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert again.json() == {"status": "stopped"}
    r = client.post("/v1/pool/heartbeat", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert r.status_code == 409 and r.json()["error"]["code"] == "pool_stopped"
    assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["status"] == "active"
    unknown = client.post(
        "/v1/pool/deregister", json={"pool_id": "pool_000000000000"}, headers=WORKER_HEADERS
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "pool_not_found"


def test_a_run_queued_on_its_tenants_quota_says_so(client) -> None:
    """Without a pool, runs are admitted to the configured slots: a third run of a tenant whose
    quota is 2 waits for that quota, which GET said was a pool (none needed here); a run queued on
    full slots of another tenant's runs says that."""
    tenant = new_tenant(client, quota=2)
    first, second, third = (create_run(client, tenant) for _ in range(3))
    assert [first["status"], second["status"], third["status"]] == ["active", "active", "queued"]
    got = client.get(f"/v1/runs/{third['id']}", headers=tenant.headers).json()
    assert got["waiting_reason"] == "the tenant's quota of 2 concurrent runs is in use"
    # The same words as the run.queued event (one function for both).
    events = client.get(f"/v1/runs/{third['id']}/events", headers=tenant.headers).json()["items"]
    assert got["waiting_reason"] in [
        e["details"].get("reason") for e in events if e["action"] == "run.queued"
    ]
