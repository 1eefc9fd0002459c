"""The Tinker API's JSON routes take JSON only: a body sent as text/plain (or any type but JSON) was
validated by FastAPI as bytes, a 422 saying the body is not an object, which sends a client looking
for a wrong field. It is a 415 in the uniform body naming application/json, as /v1 answers a body it
does not read (POST /v1/runs, rollout batches), after the caller's 401, and nothing is stored.

A body without a Content-Type is a 415 too: FastAPI reads it as bytes (its strict_content_type), and
it was the same 422. What the official SDK sends is unchanged: application/json on every call
(application/x-protobuf to forward_backward, a route that reads its own body);
tests/app/test_tinker_sdk*.py drive the SDK itself. Both databases."""

import json
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.tinker.router import router
from tests.app.api import TenantHandle
from tests.app.tinker_calls import new_session, stored, tinker_headers

JSON_ROUTES = sorted(
    route.path.removeprefix("/api/v1")
    for route in router.routes
    if isinstance(route, APIRoute) and route.body_field is not None
)
"""Every Tinker route FastAPI reads a JSON body for (a route added later is checked too)."""


def test_the_json_routes_are_the_ones_the_sdk_sends_json_to() -> None:
    assert {"/create_session", "/create_model", "/optim_step", "/asample", "/retrieve_future"} <= set(
        JSON_ROUTES
    )
    assert "/forward_backward" not in JSON_ROUTES  # protobuf, read by the route itself


def _refused_as_415(r: Any, media: str) -> None:
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type", error
    assert "application/json" in error["message"] and repr(media) in error["message"], error
    assert error["details"] == {"content_type": media, "accepted": ["application/json"]}


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize(
    # text/x+json: FastAPI reads only application/*+json as JSON (it got the old 422)
    "media",
    ["text/plain", "application/x-www-form-urlencoded", "application/x-protobuf", "text/x+json"],
)
def test_a_json_route_answers_another_body_type_with_a_415_naming_application_json(
    client: TestClient, tenant: TenantHandle, db: Session, path: str, media: str
) -> None:
    session_id = new_session(client, tenant)
    before = stored(db)
    body = json.dumps({"session_id": session_id, "model_seq_id": 0, "base_model": "loraloom-tiny"})
    r = client.post(
        f"/api/v1{path}",
        content=body,
        headers=tinker_headers(tenant) | {"Content-Type": f"{media}; charset=utf-8"},
    )
    _refused_as_415(r, media)
    assert stored(db) == before


@pytest.mark.parametrize("path", ["/create_session", "/retrieve_future", "/optim_step"])
def test_an_unknown_caller_gets_its_401_before_any_word_about_the_body(client: TestClient, path: str) -> None:
    r = client.post(
        f"/api/v1{path}", content=b"hello", headers={"X-API-Key": "tml-wrong", "Content-Type": "text/plain"}
    )
    assert r.status_code == 401, r.text


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "Application/JSON; charset=utf-8", "application/vnd.tinker+json"],
)
def test_json_of_any_spelling_is_read_as_json(
    client: TestClient, tenant: TenantHandle, content_type: str
) -> None:
    body = json.dumps({"tags": ["media"], "sdk_version": "test"}).encode()
    r = client.post(
        "/api/v1/create_session",
        content=body,
        headers=tinker_headers(tenant) | {"Content-Type": content_type},
    )
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "create_session"


def test_a_body_without_a_content_type_is_a_415_and_no_body_is_left_to_the_route(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    """FastAPI reads a body without a Content-Type as bytes (its strict_content_type): it was the
    same 422 "not a valid dictionary". No body at all is the route's own answer (a missing field)."""
    before = stored(db)
    body = json.dumps({"tags": [], "sdk_version": "test"}).encode()
    r = client.post("/api/v1/create_session", content=body, headers=tinker_headers(tenant))
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["message"] == "a body without a Content-Type; send application/json", error
    assert error["details"] == {"content_type": None, "accepted": ["application/json"]}
    r = client.post("/api/v1/session_heartbeat", headers=tinker_headers(tenant))
    assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["body"], r.text
    assert stored(db) == before
