"""The /v1 routes with a typed JSON body take JSON only (app/http_semantics.py `JsonBodyRoute`): a body
sent as text/plain, or any type FastAPI does not read as JSON, was validated as bytes, a 422 "Input
should be a valid dictionary" that sends a client looking for a wrong field. It is a 415 in the
uniform body naming the type received and application/json, after the caller's 401, 403 and 404, as
the Tinker API answers (tests/app/test_tinker_media_type.py), and nothing is stored.

A body without a Content-Type is a 415 too: FastAPI (strict_content_type) read it as bytes, the same
422, so no client sending JSON without the header ever got through. `POST /v1/runs` reads its own
body (JSON, header or not, or TOML) and is left as it was. Both databases."""

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.config import Settings
from app.http_semantics import JsonBodyRoute, reads_json_body
from app.main import create_app
from app.models import Base
from app.openapi import ERROR_REF, api_routes, build_documents
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, TenantHandle, create_run, new_tenant, register

# The pool's routes with a typed JSON body whose 415 is not called below (their bodies take a pool
# with claimed work to set up): the route-class check and the OpenAPI document cover them.
POOL_ONLY = {
    "ackBatches",
    "claimBatches",
    "poolClaimManualWork",
    "poolManualResults",
    "restartRunFromCheckpoint",
}


def _json_body_routes(app: FastAPI) -> list[Any]:
    return [r for r in api_routes(app) if r.path_format.startswith("/v1/") and reads_json_body(r)]


def _route_cases() -> list[Any]:
    cases = []
    # The routes only (at collection): an engine on a memory database that is never connected.
    for route in _json_body_routes(create_app(Settings(database_url="sqlite://"))):
        for method in sorted(route.methods):
            cases.append(pytest.param(route, id=f"{method} {route.path_format}"))
    return cases


@pytest.mark.parametrize("route", _route_cases())
def test_every_v1_route_with_a_typed_json_body_takes_json_only(route: Any) -> None:
    """A route added later with a typed body, on a router without the route class, fails here."""
    assert isinstance(getattr(route, "original_route", route), JsonBodyRoute)


# --------------------------------------------------------------------------- the routes, called


def _snapshot(db: Session) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, so that a refused request is seen to have stored nothing."""
    db.expire_all()
    rows = {
        table.name: sorted((tuple(map(repr, row)) for row in db.execute(select(table))), key=repr)
        for table in Base.metadata.sorted_tables
    }
    db.rollback()  # ends the read (on SQLite an open reader holds the writers back)
    return rows


class Scene:
    """A tenant with an active run and a registered pool: what each route's body refers to."""

    def __init__(self, client: TestClient) -> None:
        self.tenant = new_tenant(client, quota=2)
        self.other = new_tenant(client, quota=2)
        self.run_id: str = create_run(client, self.tenant, name="r")["id"]
        self.pool_id = register(client)

    def calls(self) -> dict[str, tuple[str, str, dict[str, str], dict[str, Any], int]]:
        """Each route's call (method, path, credential, a valid body, its status as JSON)."""
        run = self.run_id
        return {
            "createTenant": ("POST", "/v1/tenants", ADMIN_HEADERS, {"name": "globex"}, 201),
            "updateTenant": (
                "PATCH",
                f"/v1/tenants/{self.tenant.id}",
                ADMIN_HEADERS,
                {"max_concurrent_runs": 3},
                200,
            ),
            "evictRun": ("POST", f"/v1/runs/{run}/evict", self.tenant.headers, {"reason": "done"}, 200),
            "registerPool": (
                "POST",
                "/v1/pool/register",
                WORKER_HEADERS,
                {
                    "base_model": "other-model",
                    "vocab_size": 64,
                    "max_rank": 8,
                    "target_modules": ["q_proj"],
                    "slots": 1,
                    "world_size": 1,
                    "max_seq_len": 64,
                },
                201,
            ),
            "poolHeartbeat": ("POST", "/v1/pool/heartbeat", WORKER_HEADERS, {"pool_id": self.pool_id}, 200),
            "deletedPoolRuns": ("POST", "/v1/pool/runs/deleted", WORKER_HEADERS, {"run_ids": [run]}, 200),
            "reportStep": (
                "POST",
                f"/v1/pool/runs/{run}/steps",
                WORKER_HEADERS,
                {"step": 1, "total_tokens": 10, "total_samples": 2},
                200,
            ),
            "reportCheckpoint": (
                "POST",
                f"/v1/pool/runs/{run}/checkpoints",
                WORKER_HEADERS,
                {"step": 0, "total_samples": 0},
                201,
            ),
            "trainerEvictRun": ("POST", f"/v1/pool/runs/{run}/evict", WORKER_HEADERS, {"reason": "nan"}, 200),
            "trainerFailRun": (
                "POST",
                f"/v1/pool/runs/{run}/fail",
                WORKER_HEADERS,
                {"reason": "no init"},
                200,
            ),
            "deregisterPool": ("POST", "/v1/pool/deregister", WORKER_HEADERS, {"pool_id": self.pool_id}, 200),
        }


CALLS = [
    "createTenant",
    "updateTenant",
    "evictRun",
    "registerPool",
    "poolHeartbeat",
    "deletedPoolRuns",
    "reportStep",
    "reportCheckpoint",
    "trainerEvictRun",
    "trainerFailRun",
    "deregisterPool",
]


def test_the_calls_here_are_every_route_the_route_class_covers(app: FastAPI) -> None:
    covered = {
        r.operation_id
        for r in _json_body_routes(app)
        if isinstance(getattr(r, "original_route", r), JsonBodyRoute)
    }
    assert covered == set(CALLS) | POOL_ONLY


def _refused_as_415(r: Any, media: str | None) -> None:
    assert r.status_code == 415, r.text
    assert set(r.json()) == {"error"}
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type", error
    assert "application/json" in error["message"], error
    if media is None:
        assert error["message"] == "a body without a Content-Type; send application/json", error
    else:
        assert repr(media) in error["message"], error
    assert error["details"] == {"content_type": media, "accepted": ["application/json"]}


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize(
    # text/x+json: only application/*+json is JSON to FastAPI; none: FastAPI's strict_content_type
    "media",
    ["text/plain", "application/x-www-form-urlencoded", "application/msgpack", "text/x+json", None],
)
def test_a_body_of_another_type_is_a_415_naming_it_and_nothing_is_stored(
    client: TestClient, db: Session, name: str, media: str | None
) -> None:
    scene = Scene(client)
    method, path, credential, body, ok = scene.calls()[name]
    content = json.dumps(body).encode()
    before = _snapshot(db)
    type_header = {} if media is None else {"Content-Type": f"{media}; charset=utf-8"}
    r = client.request(method, path, content=content, headers=credential | type_header)
    _refused_as_415(r, media)
    assert _snapshot(db) == before
    # The same bytes as JSON are a body the route takes: the 415 was the type's alone.
    r = client.request(
        method, path, content=content, headers=credential | {"Content-Type": "application/json"}
    )
    assert r.status_code == ok, r.text


@pytest.mark.parametrize(
    ("taken", "refused"),
    [
        ("application/json", "application/jsonp"),
        ("Application/JSON; charset=utf-8", "text/json"),
        ("application/merge-patch+json", "application/json-patch"),
    ],
)
def test_json_of_any_spelling_fastapi_reads_is_taken_and_a_look_alike_is_not(
    client: TestClient, tenant: TenantHandle, taken: str, refused: str
) -> None:
    path, body = f"/v1/tenants/{tenant.id}", b'{"max_concurrent_runs": 5}'
    r = client.patch(path, content=body, headers=ADMIN_HEADERS | {"Content-Type": taken})
    assert r.status_code == 200 and r.json()["max_concurrent_runs"] == 5, r.text
    r = client.patch(path, content=body, headers=ADMIN_HEADERS | {"Content-Type": refused})
    _refused_as_415(r, refused)


def test_only_the_body_type_changed(client: TestClient, tenant: TenantHandle) -> None:
    """Malformed JSON, a bad field and no body at all keep their 422; `POST /v1/runs`, which reads its
    own body, still takes JSON without a Content-Type (it did) and answers another type its own 415."""
    path = f"/v1/tenants/{tenant.id}"
    r = client.patch(
        path, content=b'{"max_concurrent_runs": 0}', headers=ADMIN_HEADERS | {"Content-Type": "text/plain"}
    )
    _refused_as_415(r, "text/plain")
    json_type = ADMIN_HEADERS | {"Content-Type": "application/json"}
    r = client.patch(path, content=b'{"max_concurrent_runs": ', headers=json_type)
    assert r.status_code == 422 and r.json()["error"]["details"][0]["type"] == "json_invalid", r.text
    r = client.patch(path, content=b'{"max_concurrent_runs": 0}', headers=json_type)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["details"][0]["loc"] == ["body", "max_concurrent_runs"]
    r = client.post(f"/v1/runs/{create_run(client, tenant)['id']}/evict", headers=tenant.headers)  # no body
    assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["body"], r.text

    body = json.dumps({"name": "plain", "config": {}}).encode()
    assert client.post("/v1/runs", content=body, headers=tenant.headers).status_code == 201
    r = client.post("/v1/runs", content=body, headers=tenant.headers | {"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/toml" in r.json()["error"]["message"], r.text


# --------------------------------------------------------------------------- the documents


def test_the_documents_list_the_415_of_these_routes_and_no_other(app: FastAPI) -> None:
    public, pool = build_documents(app)
    with_415 = {
        op["operationId"]
        for doc in (public, pool)
        for item in doc["paths"].values()
        for op in item.values()
        if isinstance(op, dict) and "415" in op.get("responses", {})
    }
    # The routes that answer their own 415: a run's creation (TOML), a batch's (msgpack), the uploads (tar).
    own = {"createRun", "submitBatch", "uploadTenantAdapter", "uploadAdapter"}
    assert with_415 == set(CALLS) | POOL_ONLY | own
    for doc in (public, pool):
        for item in doc["paths"].values():
            for op in item.values():
                if isinstance(op, dict) and op.get("operationId") in CALLS:
                    response = op["responses"]["415"]
                    assert response["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}
                    assert "unsupported_media_type" in response["description"]
