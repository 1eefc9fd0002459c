"""Tenant isolation, table-driven over every route the app has (read from its OpenAPI, so
routes added later are covered without editing this file):

- every route under /v1/runs/{run_id}: another tenant's key → 404 not_found, exactly as
  for a run that does not exist, and nothing changes; no key or a revoked key → 401;
- admin routes (/v1/tenants...): a tenant key → 403; no key or a wrong key → 401;
- pool routes (/v1/pool...): a tenant key is refused; no key → 401.
"""

import pytest
from sqlalchemy import select

from app.config import Settings
from app.events.models import Event
from app.main import create_app
from app.openapi import build_documents
from app.runs.models import Run
from tests.app.api import ADMIN_HEADERS, create_run, new_tenant
from tests.app.factories import row_counts

BODY_METHODS = {"POST", "PUT", "PATCH"}
# Values for path parameters other than run_id; anything else gets "1".
SAMPLE_PATH_PARAMS = {
    "step": "latest",
    "filename": "adapter_config.json",
    "name": "adapter_config.json",
    "tenant_id": "ten_000000000000",
    "key_id": "key_000000000000",
}

# Valid bodies for routes that validate the body before looking up the run, so the check
# reaches the ownership test; anything else gets {}.
SAMPLE_BODIES = {
    "submitBatch": {
        "examples": [
            {
                "prompt_ids": [1, 2],
                "prompt_mask": [True, True],
                "completion_ids": [3],
                "completion_mask": [True],
                "completion_logprobs": [-0.5],
                "advantage": 1.0,
            }
        ]
    },
}


def _operations() -> list[tuple[str, str, str]]:
    # Both documents: the public one (tenants, admin) and the pool's.
    public, pool = build_documents(create_app(Settings(database_url="sqlite:///:memory:")))
    ops = []
    for path, item in (public["paths"] | pool["paths"]).items():
        for method, op in item.items():
            if method.upper() in {"GET", "POST", "PUT", "PATCH", "DELETE"}:
                ops.append((method.upper(), path, op.get("operationId") or f"{method} {path}"))
    return sorted(ops)


OPERATIONS = _operations()
RUN_ROUTES = [op for op in OPERATIONS if op[1].startswith("/v1/runs/{run_id}")]
# Uploaded adapters are tenant-scoped too; another tenant's is a 404 (tests/e2e/test_uploaded_adapter_e2e.py).
TENANT_ROUTES = [
    op for op in OPERATIONS if op[1].startswith(("/v1/runs", "/v1/adapters")) or op[1] == "/v1/pools"
]
ADMIN_ROUTES = [op for op in OPERATIONS if op[1].startswith(("/v1/tenants", "/v1/admin/"))]
POOL_ROUTES = [op for op in OPERATIONS if op[1].startswith("/v1/pool/")]


def _ids(ops):
    return [op_id for _, _, op_id in ops]


def _url(path: str, run_id: str = "run_000000000000") -> str:
    url = path.replace("{run_id}", run_id)
    while "{" in url:
        start, end = url.index("{"), url.index("}")
        url = url[:start] + SAMPLE_PATH_PARAMS.get(url[start + 1 : end], "1") + url[end + 1 :]
    return url


def _call(client, method: str, url: str, headers: dict, op_id: str = ""):
    body = SAMPLE_BODIES.get(op_id, {}) if method in BODY_METHODS else None
    return client.request(method, url, headers=headers, json=body)


def test_every_v1_route_is_classified():
    """A new route outside runs, tenants and pool would escape this table: decide its rules here."""
    assert {"createRun", "getRun", "evictRun", "deleteRun", "runHeartbeat", "createTenant"} <= set(
        _ids(OPERATIONS)
    )
    unclassified = [
        (m, p)
        for m, p, _ in OPERATIONS
        if p.startswith("/v1")
        and not p.startswith(("/v1/runs", "/v1/tenants", "/v1/admin/", "/v1/pool/", "/v1/adapters"))
        and p != "/v1/pools"
    ]
    assert unclassified == []


@pytest.mark.parametrize(("method", "path", "op_id"), RUN_ROUTES, ids=_ids(RUN_ROUTES))
def test_another_tenants_run_is_404(client, settings, method, path, op_id):
    owner = new_tenant(client)
    intruder = new_tenant(client)
    victim = create_run(client, owner)
    before = row_counts(settings, Run, Event)

    r = _call(client, method, _url(path, victim["id"]), intruder.headers, op_id)
    assert r.status_code == 404, f"{op_id}: {r.status_code} {r.text}"
    assert r.json()["error"]["code"] == "not_found"
    # Indistinguishable from a run that does not exist.
    missing = _call(client, method, _url(path), owner.headers, op_id)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

    # Nothing changed for the owner.
    after = client.get(f"/v1/runs/{victim['id']}", headers=owner.headers).json()
    assert (after["status"], after["slot"], after["updated_at"]) == (
        victim["status"],
        victim["slot"],
        victim["updated_at"],
    )
    assert row_counts(settings, Run, Event) == before


@pytest.mark.parametrize(("method", "path", "op_id"), TENANT_ROUTES, ids=_ids(TENANT_ROUTES))
def test_tenant_routes_need_a_valid_key(client, method, path, op_id):
    owner = new_tenant(client)
    run = create_run(client, owner)
    url = _url(path, run["id"])
    for headers in (
        {},
        {"Authorization": "Bearer llk_not-a-key"},
        {"Authorization": "Basic xyz"},
        ADMIN_HEADERS,
    ):
        r = _call(client, method, url, headers)
        assert r.status_code == 401, f"{op_id} with {headers}: {r.status_code}"
        assert r.json()["error"]["code"] == "unauthorized"
    client.delete(f"/v1/tenants/{owner.id}/keys/{owner.key_id}", headers=ADMIN_HEADERS)
    r = _call(client, method, url, owner.headers)
    assert r.status_code == 401, f"{op_id} with a revoked key: {r.status_code}"


@pytest.mark.parametrize(("method", "path", "op_id"), ADMIN_ROUTES, ids=_ids(ADMIN_ROUTES))
def test_admin_routes(client, method, path, op_id):
    t = new_tenant(client)
    url = _url(path).replace("ten_000000000000", t.id).replace("key_000000000000", t.key_id)
    r = _call(client, method, url, t.headers)
    assert r.status_code == 403, f"{op_id}: {r.status_code}"
    assert r.json()["error"]["code"] == "forbidden"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = _call(client, method, url, headers)
        assert r.status_code == 401, f"{op_id}: {r.status_code}"
    # The key is still valid: nothing was done by the refused calls.
    assert client.get("/v1/runs", headers=t.headers).status_code == 200


@pytest.mark.parametrize(("method", "path", "op_id"), POOL_ROUTES, ids=_ids(POOL_ROUTES))
def test_pool_routes_refuse_tenant_keys(client, method, path, op_id):
    t = new_tenant(client)
    run = create_run(client, t)
    url = _url(path, run["id"])
    assert _call(client, method, url, t.headers).status_code == 403, op_id  # a known key, wrong route
    assert _call(client, method, url, {}).status_code == 401, op_id


def test_listing_shows_only_own_runs(client, db):
    a = new_tenant(client)
    b = new_tenant(client)
    mine = {create_run(client, a)["id"] for _ in range(2)}
    theirs = create_run(client, b)["id"]
    listed = {r["id"] for r in client.get("/v1/runs", headers=a.headers).json()["items"]}
    assert listed == mine
    assert theirs in {r.id for r in db.scalars(select(Run))}


def test_owner_reaches_every_runs_route_of_this_service(client):
    """The other side of the 404s: the owner gets through (the routes this module checks by hand)."""
    owner = new_tenant(client)
    run = create_run(client, owner)
    rid = run["id"]
    assert client.get(f"/v1/runs/{rid}", headers=owner.headers).status_code == 200
    assert client.post(f"/v1/runs/{rid}/heartbeat", headers=owner.headers).status_code == 200
    assert (
        client.post(f"/v1/runs/{rid}/evict", json={"reason": "x"}, headers=owner.headers).status_code == 200
    )
    assert client.delete(f"/v1/runs/{rid}", headers=owner.headers).status_code == 200
