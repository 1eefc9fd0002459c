"""The run lifecycle and slot admission, end to end over HTTP (DESIGN §3)."""

import tomllib
from datetime import timedelta

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.db import utcnow
from app.errors import Conflict
from app.events.models import Event
from app.main import create_app
from app.runs import service
from app.runs.models import Run
from tests.app.api import TenantHandle, create_run, new_tenant, register
from tests.app.factories import make_run, make_tenant


def _get(http: httpx.Client, tenant: TenantHandle, run_id: str) -> dict:
    r = http.get(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert r.status_code == 200, r.text
    return r.json()


def test_whole_lifecycle_over_real_http(settings, http, db):
    """Under uvicorn, 2 slots: create → active; slots full → queued; evict → the queued run
    gets the slot; completion frees a slot; deletion too."""
    acme = new_tenant(http, quota=3)
    globex = new_tenant(http, quota=3)

    r1 = create_run(http, acme, name="one")
    assert (r1["status"], r1["slot"]) == ("active", 0)
    assert r1["started_at"] is not None
    r2 = create_run(http, globex, name="two")
    assert (r2["status"], r2["slot"]) == ("active", 1)
    r3 = create_run(http, acme, name="three")
    assert (r3["status"], r3["slot"]) == ("queued", None)

    # Evicting frees slot 1; the oldest queued run takes it.
    r = http.post(f"/v1/runs/{r2['id']}/evict", json={"reason": "plateaued"}, headers=globex.headers)
    assert r.status_code == 200, r.text
    evicted = r.json()
    assert (evicted["status"], evicted["slot"], evicted["evicted_by"]) == ("evicted", None, "user")
    assert evicted["eviction_reason"] == "plateaued"
    assert evicted["finished_at"] is not None
    assert _get(http, acme, r3["id"])["status"] == "active"
    assert _get(http, acme, r3["id"])["slot"] == 1

    # Completion (the trainer's call, through the service) frees slot 0 for the next queued run.
    r4 = create_run(http, globex, name="four")
    assert r4["status"] == "queued"
    run1 = service.get_run(db, run_id=r1["id"])
    service.complete_run(db, run=run1, settings=settings)
    db.commit()
    assert _get(http, acme, r1["id"])["status"] == "completed"
    assert (_get(http, globex, r4["id"])["status"], _get(http, globex, r4["id"])["slot"]) == ("active", 0)

    # Deletion frees a slot too, and removes the run's directory.
    r5 = create_run(http, acme, name="five")
    assert r5["status"] == "queued"
    assert (settings.runs_dir / r3["id"]).is_dir()
    r = http.delete(f"/v1/runs/{r3['id']}", headers=acme.headers)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "deleted"
    assert not (settings.runs_dir / r3["id"]).exists()
    assert (_get(http, acme, r5["id"])["status"], _get(http, acme, r5["id"])["slot"]) == ("active", 1)

    # Finished runs cannot move: 409 with a clear message.
    r = http.post(f"/v1/runs/{r2['id']}/evict", json={"reason": "again"}, headers=globex.headers)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "invalid_transition"
    assert "evicted" in r.json()["error"]["message"]

    actions = [e.action for e in db.scalars(select(Event).where(Event.run_id == r3["id"]).order_by(Event.id))]
    assert actions == ["run.created", "run.queued", "run.admitted", "run.deleted"]


def test_quota_queues_runs_beyond_it(client, settings):
    t = new_tenant(client, quota=1)
    other = new_tenant(client, quota=1)
    first = create_run(client, t)
    second = create_run(client, t)
    assert (first["status"], second["status"]) == ("active", "queued")
    # A free slot is not enough: the quota holds the run back, and another tenant may take the slot.
    third = create_run(client, other)
    assert third["status"] == "active"


def test_a_tenant_may_queue_only_so_many_runs(settings):
    """Queued runs were unbounded, and every admission read them all (configs included) under the
    service-wide lock: one tenant's 250 queued runs made every tenant's run creation take 2 s."""
    settings = settings.model_copy(update={"tenant_max_queued_runs": 2})
    with TestClient(create_app(settings)) as client:
        t = new_tenant(client, quota=1)
        create_run(client, t)  # active: the quota is full from here on
        queued = [create_run(client, t)["id"] for _ in range(2)]
        refused = client.post("/v1/runs", json={"name": "one-too-many", "config": {}}, headers=t.headers)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["details"] == {"kind": "queued_runs", "queued_runs": 2, "limit": 2}
        assert int(refused.headers["retry-after"]) >= 1
        names = [r["name"] for r in client.get("/v1/runs", headers=t.headers).json()["items"]]
        assert "one-too-many" not in names
        # Another tenant is not affected; a queued run that leaves makes room.
        assert create_run(client, new_tenant(client, quota=1))["status"] == "active"
        client.post(f"/v1/runs/{queued[0]}/evict", json={"reason": "x"}, headers=t.headers)
        assert create_run(client, t)["status"] == "queued"


def test_freed_quota_admits_the_tenants_run_on_another_base_model(client):
    t = new_tenant(client, quota=1)
    a = create_run(client, t, base_model="model-a")
    b = create_run(client, t, base_model="model-b")
    assert (a["status"], b["status"]) == ("active", "queued")
    r = client.post(f"/v1/runs/{a['id']}/evict", json={"reason": "done"}, headers=t.headers)
    assert r.status_code == 200
    b = client.get(f"/v1/runs/{b['id']}", headers=t.headers).json()
    assert (b["status"], b["slot"]) == ("active", 0)  # slots are per base model


def test_first_come_first_served(client):
    a = new_tenant(client, quota=3)
    b = new_tenant(client, quota=3)
    create_run(client, a)
    blocker = create_run(client, a)
    older = create_run(client, b, name="older")
    newer = create_run(client, a, name="newer")
    client.post(f"/v1/runs/{blocker['id']}/evict", json={"reason": "x"}, headers=a.headers)
    assert client.get(f"/v1/runs/{older['id']}", headers=b.headers).json()["status"] == "active"
    assert client.get(f"/v1/runs/{newer['id']}", headers=a.headers).json()["status"] == "queued"


def test_toml_body(client, tenant, settings):
    body = b'name = "from-toml"\n\n[config]\nmax_steps = 7\n\n[config.lora]\nrank = 4\ntarget_modules = ["q_proj"]\n'
    r = client.post("/v1/runs", content=body, headers={**tenant.headers, "Content-Type": "application/toml"})
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["name"] == "from-toml"
    assert run["config"]["max_steps"] == 7
    assert run["config"]["lora"]["rank"] == 4
    assert run["config"]["lora"]["target_modules"] == ["q_proj"]
    orch = tomllib.loads((settings.runs_dir / run["id"] / "control" / "orch.toml").read_text())
    assert orch["lora"]["rank"] == 4


def test_idempotent_create(client, tenant, db):
    headers = {**tenant.headers, "Idempotency-Key": "create-1"}
    body = {"name": "idem", "config": {"max_steps": 5}}
    first = client.post("/v1/runs", json=body, headers=headers)
    assert first.status_code == 201
    replay = client.post("/v1/runs", json=body, headers=headers)
    assert replay.status_code == 200
    assert replay.json()["id"] == first.json()["id"]
    # The same body with its keys in another order, or as TOML, is the same request.
    reordered = client.post(
        "/v1/runs",
        content=b'{"config": {"max_steps": 5}, "name": "idem"}',
        headers={**headers, "Content-Type": "application/json"},
    )
    assert (reordered.status_code, reordered.json()["id"]) == (200, first.json()["id"])
    toml = b'name = "idem"\n[config]\nmax_steps = 5\n'
    as_toml = client.post("/v1/runs", content=toml, headers={**headers, "Content-Type": "application/toml"})
    assert as_toml.status_code == 200
    assert as_toml.json()["id"] == first.json()["id"]

    other = client.post("/v1/runs", json={**body, "name": "different"}, headers=headers)
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_conflict"
    assert len(db.scalars(select(Run)).all()) == 1
    db.rollback()  # end the read: on SQLite every transaction holds the write lock

    # Keys are per tenant: another tenant's identical key is its own request.
    other_tenant = new_tenant(client)
    r = client.post("/v1/runs", json=body, headers={**other_tenant.headers, "Idempotency-Key": "create-1"})
    assert r.status_code == 201
    assert r.json()["id"] != first.json()["id"]


def test_list_pagination_and_status_filter(client, tenant):
    ids = [create_run(client, tenant, name=f"r{i}")["id"] for i in range(5)]  # 2 active, 3 queued
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = client.get("/v1/runs", params=params, headers=tenant.headers).json()
        assert len(page["items"]) <= 2
        seen += [r["id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))  # newest first, nothing skipped or repeated

    queued = client.get("/v1/runs", params={"status": "queued"}, headers=tenant.headers).json()["items"]
    assert {r["id"] for r in queued} == set(ids[2:])

    client.delete(f"/v1/runs/{ids[0]}", headers=tenant.headers)
    listed = {r["id"] for r in client.get("/v1/runs", headers=tenant.headers).json()["items"]}
    assert ids[0] not in listed
    deleted = client.get("/v1/runs", params={"status": "deleted"}, headers=tenant.headers).json()["items"]
    assert [r["id"] for r in deleted] == [ids[0]]


def test_transitions(client, tenant, settings, db):
    active = create_run(client, tenant)
    create_run(client, tenant)
    queued = create_run(client, tenant)

    # A queued run can be evicted (it held no slot); an orchestrator can evict its own run.
    r = client.post(
        f"/v1/runs/{queued['id']}/evict",
        json={"reason": "no signal", "by": "orchestrator"},
        headers=tenant.headers,
    )
    assert r.status_code == 200
    assert (r.json()["status"], r.json()["evicted_by"]) == ("evicted", "orchestrator")

    # Only active runs complete.
    run = service.get_run(db, run_id=queued["id"])
    with pytest.raises(Conflict, match="only active runs can be completed"):
        service.complete_run(db, run=run, settings=settings)
    db.rollback()

    # Finished runs can be deleted, once.
    assert client.delete(f"/v1/runs/{queued['id']}", headers=tenant.headers).status_code == 200
    again = client.delete(f"/v1/runs/{queued['id']}", headers=tenant.headers)
    assert again.status_code == 409
    assert again.json()["error"]["message"] == f"run {queued['id']} is already deleted"
    assert (
        client.post(
            f"/v1/runs/{queued['id']}/evict", json={"reason": "x"}, headers=tenant.headers
        ).status_code
        == 409
    )
    # A deleted run stays readable.
    assert client.get(f"/v1/runs/{queued['id']}", headers=tenant.headers).json()["status"] == "deleted"
    assert client.get(f"/v1/runs/{active['id']}", headers=tenant.headers).json()["status"] == "active"


def test_fail_run_frees_slot_and_writes_the_error(client, tenant, settings, db):
    run = create_run(client, tenant)
    create_run(client, tenant)
    other = new_tenant(client)
    waiting = create_run(client, other)
    assert waiting["status"] == "queued"
    service.fail_run(
        db, run=service.get_run(db, run_id=run["id"]), reason="rank 64 > pool max_rank 16", settings=settings
    )
    db.commit()
    got = client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()
    assert (got["status"], got["failure_reason"]) == ("failed", "rank 64 > pool max_rank 16")
    error_file = settings.runs_dir / run["id"] / "control" / "config_validation_error.txt"
    assert error_file.read_text().strip() == "rank 64 > pool max_rank 16"
    assert client.get(f"/v1/runs/{waiting['id']}", headers=other.headers).json()["status"] == "active"


def test_a_run_the_live_pool_cannot_train_is_a_422(client, tenant, settings):
    # Admission asks the live pool of the run's base model what it can train (max_rank 16).
    register(client, max_rank=16)
    ok = create_run(client, tenant, lora={"rank": 8})
    assert ok["status"] == "active"
    r = client.post(
        "/v1/runs", json={"name": "big", "config": {"lora": {"rank": 32}}}, headers=tenant.headers
    )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error" and "max_rank 16" in error["message"]
    assert [(d["loc"], d["limit"]) for d in error["details"]] == [(["body", "config", "lora", "rank"], 16)]
    runs = client.get("/v1/runs", headers=tenant.headers).json()["items"]
    assert [run["id"] for run in runs] == [ok["id"]]  # nothing stored
    assert sorted(p.name for p in settings.runs_dir.iterdir()) == [ok["id"]]


def test_heartbeat(client, tenant):
    run = create_run(client, tenant)
    r = client.post(f"/v1/runs/{run['id']}/heartbeat", headers=tenant.headers)
    assert r.status_code == 200
    assert r.json()["run_id"] == run["id"]
    assert r.json()["status"] == "active"
    assert r.json()["last_heartbeat_at"] is not None
    client.post(f"/v1/runs/{run['id']}/evict", json={"reason": "bye"}, headers=tenant.headers)
    # An evicted run's orchestrator learns it from its heartbeat.
    r = client.post(f"/v1/runs/{run['id']}/heartbeat", headers=tenant.headers)
    assert (r.status_code, r.json()["status"]) == (200, "evicted")


def test_evict_silent_runs(client, tenant, settings, db):
    silent = create_run(client, tenant, heartbeat_timeout=30)
    alive = create_run(client, tenant, heartbeat_timeout=30)
    untimed_tenant = new_tenant(client)
    untimed = create_run(client, untimed_tenant)  # no timeout: never evicted for silence
    assert untimed["status"] == "queued"

    later = utcnow() + timedelta(seconds=60)
    service.heartbeat(db, run=service.get_run(db, run_id=alive["id"]))
    db.get(Run, alive["id"]).last_heartbeat_at = later - timedelta(seconds=5)
    db.commit()

    evicted = service.evict_silent_runs(db, now=later, settings=settings)
    db.commit()
    assert [r.id for r in evicted] == [silent["id"]]
    got = client.get(f"/v1/runs/{silent['id']}", headers=tenant.headers).json()
    assert (got["status"], got["evicted_by"]) == ("evicted", "heartbeat")
    assert "heartbeat_timeout" in got["eviction_reason"] and "30s" in got["eviction_reason"]
    assert client.get(f"/v1/runs/{alive['id']}", headers=tenant.headers).json()["status"] == "active"
    # The freed slot went to the queued run.
    assert (
        client.get(f"/v1/runs/{untimed['id']}", headers=untimed_tenant.headers).json()["status"] == "active"
    )
    ev = db.scalars(select(Event).where(Event.run_id == silent["id"], Event.action == "run.evicted")).one()
    assert ev.actor == "heartbeat"


def test_slot_index_backstop_keeps_run_queued(settings, db):
    """If a slot turns out to be taken, the unique index refuses it and the run stays queued."""
    tenant, _ = make_tenant(db)
    make_run(db, tenant, status="active", slot=0)
    waiting = make_run(db, tenant, status="queued")
    assert service._take_slot(db, run=waiting, slot=0) is False
    assert waiting.status == "queued"
    assert service._take_slot(db, run=waiting, slot=1) is True
    db.commit()
    assert db.get(Run, waiting.id).slot == 1


def test_events_record_who_and_which_key(client, tenant, db):
    run = create_run(client, tenant)
    client.post(f"/v1/runs/{run['id']}/evict", json={"reason": "stop"}, headers=tenant.headers)
    events = db.scalars(select(Event).where(Event.run_id == run["id"]).order_by(Event.id)).all()
    assert [(e.action, e.actor) for e in events] == [
        ("run.created", "tenant"),
        ("run.admitted", "system"),
        ("run.evicted", "tenant"),
    ]
    assert events[0].api_key_id == tenant.key_id
    assert events[2].api_key_id == tenant.key_id
    assert events[2].details["reason"] == "stop"
    assert all(e.tenant_id == tenant.id and e.at is not None for e in events)
