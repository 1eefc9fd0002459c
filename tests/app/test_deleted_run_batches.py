"""A deleted run's batches are the 404 of its metrics and adapters (tests/app/test_deleted_run_adapters.py,
tests/app/test_htk_deleted_run_metrics.py): GET /v1/runs/{id}/batches still listed every batch of a
deleted run, whose rows stay until the run is purged, the untrained ones as `pending` forever (their
payloads went with the run's directory). Now each form of the listing answers that same 404, whose
details say the run is deleted; another tenant's deleted run is the plain 404 of an unknown run. So
does every other per-run read under /v1/runs/{run_id}/, read from the app's routes (later ones are
covered). Both databases."""

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.batches.models import Batch
from app.config import Settings
from app.openapi import api_routes, build_documents
from tests.app.api import TenantHandle, batch_body, create_run
from tests.app.factories import committed

READS = ["", "?state=pending", "?limit=1", "?state=trained&limit=500"]
"""Each form of the batches listing (the cursor's form is read from a page: `_cursor_read`)."""

NOT_A_READ_OF_ITS_RECORDS = {"/v1/runs/{run_id}/events"}
"""Per-run reads that stay answered for a deleted run: its events are the audit trail (the run's
deletion among them), as GET /v1/runs/{run_id} still shows the run."""


def _batch_rows(settings: Settings, run_id: str) -> int:
    with committed(settings) as session:
        return int(session.scalar(select(func.count()).select_from(Batch).where(Batch.run_id == run_id)) or 0)


@pytest.fixture
def deleted(client: TestClient, tenant: TenantHandle, settings: Settings) -> str:
    """A run that was sent three batches, listed (as pending), then deleted; its id."""
    run_id: str = create_run(client, tenant)["id"]
    for seed in range(3):
        r = client.post(f"/v1/runs/{run_id}/batches", json=batch_body(2, seed=seed), headers=tenant.headers)
        assert r.status_code == 201, r.text
    listed = client.get(f"/v1/runs/{run_id}/batches", headers=tenant.headers)
    assert listed.status_code == 200, listed.text
    assert [b["state"] for b in listed.json()["items"]] == ["pending"] * 3
    assert client.delete(f"/v1/runs/{run_id}", headers=tenant.headers).status_code == 200
    assert _batch_rows(settings, run_id) == 3  # the rows stay (until the purge): the listing's source
    return run_id


def _assert_deleted_runs_404(response: Any, run_id: str, what: str) -> None:
    assert response.status_code == 404, response.text
    assert response.json()["error"] == {
        "code": "not_found",
        "message": f"run {run_id} was deleted, and its {what} with it",
        "details": {"run_id": run_id, "status": "deleted"},
    }


@pytest.mark.parametrize("read", READS)
def test_a_deleted_runs_batches_are_the_404_of_its_metrics(
    client: TestClient, tenant: TenantHandle, deleted: str, read: str
) -> None:
    r = client.get(f"/v1/runs/{deleted}/batches{read}", headers=tenant.headers)
    _assert_deleted_runs_404(r, deleted, "batches")
    metrics = client.get(f"/v1/runs/{deleted}/metrics", headers=tenant.headers)
    assert {**r.json()["error"], "message": None} == {**metrics.json()["error"], "message": None}
    # The run itself is still shown, as deleted.
    shown = client.get(f"/v1/runs/{deleted}", headers=tenant.headers)
    assert shown.status_code == 200 and shown.json()["status"] == "deleted", shown.text


def test_a_cursor_taken_before_the_deletion_is_the_same_404(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    """A client paging through the listing while the run is deleted: its next page is the 404."""
    run_id: str = create_run(client, tenant)["id"]
    for seed in range(2):
        r = client.post(f"/v1/runs/{run_id}/batches", json=batch_body(1, seed=seed), headers=tenant.headers)
        assert r.status_code == 201, r.text
    first = client.get(f"/v1/runs/{run_id}/batches?limit=1", headers=tenant.headers).json()
    assert first["next_cursor"] is not None
    assert client.delete(f"/v1/runs/{run_id}", headers=tenant.headers).status_code == 200
    r = client.get(
        f"/v1/runs/{run_id}/batches",
        params={"limit": 1, "cursor": first["next_cursor"]},
        headers=tenant.headers,
    )
    _assert_deleted_runs_404(r, run_id, "batches")


@pytest.mark.parametrize("read", READS[:2])
def test_another_tenants_deleted_run_is_the_404_of_an_unknown_run(
    client: TestClient, other_tenant: TenantHandle, deleted: str, read: str
) -> None:
    r = client.get(f"/v1/runs/{deleted}/batches{read}", headers=other_tenant.headers)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {"code": "not_found", "message": f"run {deleted} not found", "details": None}


def _per_run_reads(app: FastAPI) -> list[str]:
    """Every tenant GET route under /v1/runs/{run_id}/, its path parameters filled in."""
    paths = {
        route.path_format
        for route in api_routes(app)
        if "GET" in route.methods
        and route.path_format.startswith("/v1/runs/{run_id}/")
        and route.path_format not in NOT_A_READ_OF_ITS_RECORDS
    }
    fill = {"{step}": "1", "{name}": "adapter_config.json"}
    out = []
    for path in sorted(paths):
        for param, value in fill.items():
            path = path.replace(param, value)
        assert "{" not in path.replace("{run_id}", ""), f"fill in the parameters of {path}"
        out.append(path)
    return out


def test_every_per_run_read_of_a_deleted_run_is_the_same_404(
    app: FastAPI, client: TestClient, tenant: TenantHandle, deleted: str
) -> None:
    """Listed from the app's routes: a per-run read added later answers a deleted run as these do."""
    reads = _per_run_reads(app)
    assert {"/v1/runs/{run_id}/batches", "/v1/runs/{run_id}/metrics", "/v1/runs/{run_id}/adapters"} <= set(
        reads
    )
    errors = {}
    for path in reads:
        r = client.get(path.format(run_id=deleted), headers=tenant.headers)
        assert r.status_code == 404, (path, r.text)
        errors[path] = {**r.json()["error"], "message": None}
    assert all(
        e == {"code": "not_found", "message": None, "details": {"run_id": deleted, "status": "deleted"}}
        for e in errors.values()
    ), errors


def test_the_document_lists_the_404_of_the_batches_listing(app: FastAPI) -> None:
    """The route's 404 with its `Error` body, and its description saying a deleted run's is one."""
    public, _ = build_documents(app)
    operation = public["paths"]["/v1/runs/{run_id}/batches"]["get"]
    assert operation["operationId"] == "listBatches"
    not_found = operation["responses"]["404"]
    assert not_found["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
    assert "deleted run's batches are a 404" in operation["description"]
