"""Admin API: tenants and API keys (stored hashed, shown once, revocable)."""

import json

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.auth import hash_key
from app.config import Settings
from app.events.models import Event
from app.main import create_app
from app.tenants.models import ApiKey, Tenant
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, new_tenant


def test_create_and_list_tenants(client):
    r = client.post("/v1/tenants", json={"name": "acme", "max_concurrent_runs": 3}, headers=ADMIN_HEADERS)
    assert r.status_code == 201
    body = r.json()
    assert body["name"] == "acme" and body["max_concurrent_runs"] == 3
    assert body["id"].startswith("ten_") and body["created_at"].endswith("Z")
    items = client.get("/v1/tenants", headers=ADMIN_HEADERS).json()["items"]
    assert [t["id"] for t in items] == [body["id"]]


def test_default_quota(client):
    r = client.post("/v1/tenants", json={"name": "q"}, headers=ADMIN_HEADERS)
    assert r.json()["max_concurrent_runs"] == 2


def test_duplicate_name_is_a_conflict(client):
    client.post("/v1/tenants", json={"name": "acme"}, headers=ADMIN_HEADERS)
    r = client.post("/v1/tenants", json={"name": "acme"}, headers=ADMIN_HEADERS)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "conflict"


@pytest.mark.parametrize(
    "body",
    [
        {"name": ""},
        {"name": "has space"},
        {"name": "x" * 129},
        {"name": "ok", "max_concurrent_runs": 0},
        {"name": "ok", "max_concurrent_runs": 10_000},
        {"name": "ok", "unknown": 1},
        {},
    ],
)
def test_invalid_tenant(client, settings, body):
    r = client.post("/v1/tenants", json=body, headers=ADMIN_HEADERS)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "validation_error"
    assert r.json()["error"]["details"]


def test_keys_are_hashed_shown_once_and_revocable(client, db):
    t = new_tenant(client)
    assert t.key.startswith("llk_")
    row = db.get(ApiKey, t.key_id)
    assert row.key_hash == hash_key(t.key)
    assert t.key.startswith(row.prefix) and len(row.prefix) < len(t.key)
    db.rollback()
    assert client.get("/v1/runs", headers=t.headers).status_code == 200

    # A second key works alongside the first; revoking one leaves the other.
    r = client.post(f"/v1/tenants/{t.id}/keys", headers=ADMIN_HEADERS)
    second = {"Authorization": f"Bearer {r.json()['key']}"}
    r = client.delete(f"/v1/tenants/{t.id}/keys/{t.key_id}", headers=ADMIN_HEADERS)
    assert r.status_code == 204 and r.content == b""
    revoked = client.get("/v1/runs", headers=t.headers)
    assert revoked.status_code == 401
    assert revoked.json()["error"]["code"] == "unauthorized"
    assert client.get("/v1/runs", headers=second).status_code == 200
    # Revoking again changes nothing.
    assert client.delete(f"/v1/tenants/{t.id}/keys/{t.key_id}", headers=ADMIN_HEADERS).status_code == 204


def test_key_routes_404(client):
    t = new_tenant(client)
    other = new_tenant(client)
    assert client.post("/v1/tenants/ten_000000000000/keys", headers=ADMIN_HEADERS).status_code == 404
    assert (
        client.delete(f"/v1/tenants/{t.id}/keys/key_000000000000", headers=ADMIN_HEADERS).status_code == 404
    )
    # A key is revoked only through its own tenant.
    r = client.delete(f"/v1/tenants/{other.id}/keys/{t.key_id}", headers=ADMIN_HEADERS)
    assert r.status_code == 404
    assert client.get("/v1/runs", headers=t.headers).status_code == 200


def test_admin_auth(client):
    t = new_tenant(client)
    assert client.get("/v1/tenants").status_code == 401
    assert client.get("/v1/tenants", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/tenants", headers={"Authorization": "Basic abc"}).status_code == 401
    r = client.get("/v1/tenants", headers=t.headers)
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    # A key that merely looks like a tenant key is unknown: 401, not 403.
    assert client.get("/v1/tenants", headers={"Authorization": "Bearer llk_unknown"}).status_code == 401
    assert client.get("/v1/tenants", headers=WORKER_HEADERS).status_code == 403


def test_audit_log_never_holds_secrets(client, db):
    t = new_tenant(client, name="audited")
    client.delete(f"/v1/tenants/{t.id}/keys/{t.key_id}", headers=ADMIN_HEADERS)
    events = db.scalars(select(Event).order_by(Event.id)).all()
    assert [(e.action, e.actor, e.tenant_id) for e in events] == [
        ("tenant.created", "admin", t.id),
        ("api_key.created", "admin", t.id),
        ("api_key.revoked", "admin", t.id),
    ]
    assert events[1].details == {"key_id": t.key_id}
    dumped = json.dumps([e.details for e in events])
    assert t.key not in dumped and t.key[4:] not in dumped
    assert db.scalar(select(Tenant.name).where(Tenant.id == t.id)) == "audited"


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_admin_key_or_worker_token_disables_their_routes(settings, value):
    """`LORALOOM_ADMIN_KEY=` set empty answered every caller 401 "invalid admin key"; it means no key."""
    configured = Settings(**{**settings.model_dump(), "admin_key": value, "worker_token": value})
    assert configured.admin_key is None and configured.worker_token is None
    with TestClient(create_app(configured)) as client:
        r = client.get("/v1/tenants", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403 and "admin routes are disabled" in r.json()["error"]["message"]
        r = client.post(
            "/v1/pool/heartbeat", json={"pool_id": "pool_x"}, headers={"Authorization": "Bearer x"}
        )
        assert r.status_code == 403 and "pool routes are disabled" in r.json()["error"]["message"]
