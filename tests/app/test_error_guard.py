"""Every error leaves in the uniform body: a bug is a 500 with a request id (header and log), the
database unreachable a 503 with Retry-After, and /readyz is not ready on an unmigrated schema."""

import logging

import pytest
from fastapi.testclient import TestClient

from app.main import create_app
from app.runs import service as runs_service
from tests.common import create_postgres_database, drop_postgres_database


def _assert_uniform(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    return body["error"]


def test_every_response_carries_a_request_id(client, tenant):
    ids = {
        client.get("/healthz").headers["x-request-id"],
        client.get("/v1/runs", headers=tenant.headers).headers["x-request-id"],
    }
    r = client.get("/v1/runs/run_000000000000", headers=tenant.headers)
    ids.add(r.headers["x-request-id"])
    assert len(ids) == 3


def test_a_bug_is_a_uniform_500_with_its_request_id_logged(client, tenant, monkeypatch, caplog):
    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(runs_service, "list_runs", broken)
    with caplog.at_level(logging.ERROR, logger="loraloom"):
        r = client.get("/v1/runs", headers=tenant.headers)
    error = _assert_uniform(r, 500, "internal_error")
    request_id = r.headers["x-request-id"]
    assert error["details"] == {"request_id": request_id}
    assert any(request_id in rec.getMessage() and rec.exc_info for rec in caplog.records)
    # The connection stays usable: the next request on the same client answers normally.
    monkeypatch.undo()
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 200


def test_database_unreachable_is_503_with_retry_after(settings, tenant):
    down = settings.model_copy(update={"database_url": "postgresql+psycopg://nobody@127.0.0.1:1/none"})
    client = TestClient(create_app(down))  # no lifespan: start-up would need the database
    r = client.get("/v1/runs", headers=tenant.headers)
    _assert_uniform(r, 503, "database_unavailable")
    assert int(r.headers["retry-after"]) > 0
    r = client.get("/readyz")
    _assert_uniform(r, 503, "database_unavailable")
    assert client.get("/healthz").status_code == 200


@pytest.mark.postgres_only
def test_readyz_needs_the_schema_at_head(settings, client):
    assert client.get("/readyz").status_code == 200
    empty = create_postgres_database()
    try:
        unmigrated = TestClient(create_app(settings.model_copy(update={"database_url": empty})))
        error = _assert_uniform(unmigrated.get("/readyz"), 503, "schema_not_current")
        assert error["details"]["current"] is None and error["details"]["head"]
        unmigrated.app.state.engine.dispose()
    finally:
        drop_postgres_database(empty)
