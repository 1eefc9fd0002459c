"""A deleted run's metrics are the 404 of its adapters (tests/app/test_deleted_run_adapters.py):
GET /v1/runs/{id}/metrics still listed every step of a deleted run, whose step rows stay until the
run is purged, while its adapters' reads answered 404 with details saying the run is deleted. Now
the metrics answer that same 404; another tenant's deleted run is the plain 404 of an unknown run.
Both databases."""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.adapters.models import StepMetrics
from app.config import Settings
from tests.app.api import WORKER_HEADERS, TenantHandle, create_run
from tests.app.factories import committed

READS = ["/metrics", "/metrics?since_step=2", "/metrics?limit=1"]
"""Each form of the metrics listing."""


def _metric_rows(settings: Settings, run_id: str) -> int:
    with committed(settings) as session:
        return int(
            session.scalar(select(func.count()).select_from(StepMetrics).where(StepMetrics.run_id == run_id))
            or 0
        )


@pytest.fixture
def deleted(client: TestClient, tenant: TenantHandle, settings: Settings) -> str:
    """A run that reported steps 1 and 2, its metrics listed, then deleted; its id."""
    run_id: str = create_run(client, tenant, max_steps=10)["id"]
    for step in (1, 2):
        body = {"step": step, "total_tokens": 10 * step, "total_samples": step, "metrics": {"loss": 1.0}}
        r = client.post(f"/v1/pool/runs/{run_id}/steps", json=body, headers=WORKER_HEADERS)
        assert r.status_code == 200, r.text
    r = client.get(f"/v1/runs/{run_id}/metrics", headers=tenant.headers)
    assert r.status_code == 200 and [i["step"] for i in r.json()["items"]] == [1, 2], r.text
    assert client.delete(f"/v1/runs/{run_id}", headers=tenant.headers).status_code == 200
    assert _metric_rows(settings, run_id) == 2  # the rows stay (until the purge): the listing's source
    return run_id


@pytest.mark.parametrize("read", READS)
def test_a_deleted_runs_metrics_are_the_404_of_its_adapters(
    client: TestClient, tenant: TenantHandle, other_tenant: TenantHandle, deleted: str, read: str
) -> None:
    r = client.get(f"/v1/runs/{deleted}{read}", headers=tenant.headers)
    assert r.status_code == 404, r.text
    error: dict[str, Any] = r.json()["error"]
    adapters = client.get(f"/v1/runs/{deleted}/adapters", headers=tenant.headers)
    assert adapters.status_code == 404, adapters.text
    assert error["message"] == f"run {deleted} was deleted, and its metrics with it"
    assert {**error, "message": None} == {**adapters.json()["error"], "message": None}
    assert error["code"] == "not_found"
    assert error["details"] == {"run_id": deleted, "status": "deleted"}
    # The run itself is still shown, as deleted.
    shown = client.get(f"/v1/runs/{deleted}", headers=tenant.headers)
    assert shown.status_code == 200 and shown.json()["status"] == "deleted", shown.text
    # Another tenant's deleted run is the plain 404 of an unknown run: nothing says it was deleted.
    r = client.get(f"/v1/runs/{deleted}{read}", headers=other_tenant.headers)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {"code": "not_found", "message": f"run {deleted} not found", "details": None}
