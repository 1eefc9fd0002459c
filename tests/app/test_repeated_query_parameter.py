"""A query parameter given twice is a 422 naming it, on every route: no route takes a list in its
query, and the router kept the last of a repeated one silently (`GET /v1/runs?limit=1&limit=500`
listed up to 500 runs; `?name=a&name=b` stored an adapter named "b"). The request guard answers it
before anything runs (tests/app/test_hst_adapter_upload_media.py covers the upload)."""

from typing import Any

from fastapi.testclient import TestClient

from tests.app.api import TenantHandle, create_run


def _refused(r: Any, name: str) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error", error
    assert error["details"] == [
        {"loc": ["query", name], "msg": error["details"][0]["msg"], "type": "repeated_query_parameter"}
    ], error
    assert repr(name) in error["message"], error


def test_a_repeated_limit_is_refused(client: TestClient, tenant: TenantHandle) -> None:
    for name in ("a", "b"):
        create_run(client, tenant, name=name)
    assert len(client.get("/v1/runs?limit=1", headers=tenant.headers).json()["items"]) == 1
    _refused(client.get("/v1/runs?limit=1&limit=500", headers=tenant.headers), "limit")
    _refused(client.get("/v1/runs?status=active&limit=1&status=queued", headers=tenant.headers), "status")


def test_distinct_parameters_and_a_repeated_one_elsewhere(client: TestClient, tenant: TenantHandle) -> None:
    assert client.get("/v1/runs?limit=1&status=active", headers=tenant.headers).status_code == 200
    _refused(client.get("/v1/runs?limit=1&limit=1", headers=tenant.headers), "limit")  # even the same value
    _refused(client.get("/healthz?x=&x="), "x")  # blank values count
    _refused(client.get("/v1/runs?li%6Dit=1&limit=2", headers=tenant.headers), "limit")  # as decoded
