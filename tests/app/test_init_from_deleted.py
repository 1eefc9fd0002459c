"""`init_from` a deleted run is the 404 of an unknown run, and nothing is stored. A deleted run's row
stays a while (with its adapter and checkpoint rows), but its files are gone: the create answered
201, the run took a slot, and the pool evicted it once it could not load the weights (found by a
hostile-tenant probe)."""

from typing import Any

import httpx
import pytest

from app.adapters.models import Adapter, Checkpoint
from app.config import Settings
from app.runs.models import Run
from tests.app.api import create_run, new_tenant
from tests.app.factories import committed, row_counts

SOURCES: list[dict[str, Any]] = [
    {"step": 4},
    {"step": "latest"},
    {},
    {"checkpoint": 4},
    {"checkpoint": "latest", "with_optimizer": True},
]


def _with_weights(settings: Settings, run_id: str) -> None:
    """Adapter steps 1..4 and checkpoints 3 and 4, as the pool's reports leave them."""
    with committed(settings) as db:
        for step in range(1, 5):
            db.add(
                Adapter(
                    run_id=run_id,
                    step=step,
                    path=f"runs/{run_id}/broadcast/step_{step}",
                    size_bytes=1,
                    sha256="0" * 64,
                )
            )
        for step in (3, 4):
            db.add(Checkpoint(run_id=run_id, step=step, total_samples=8 * step))


def _create_from(http: httpx.Client, headers: dict[str, str], source: dict[str, Any]) -> httpx.Response:
    return http.post("/v1/runs", json={"name": "child", "init_from": source}, headers=headers)


@pytest.mark.parametrize(
    "source", SOURCES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default"
)
def test_init_from_a_deleted_run_is_a_404_and_stores_nothing(
    settings: Settings, http: httpx.Client, source: dict[str, Any]
) -> None:
    tenant = new_tenant(http, quota=4)
    parent = create_run(http, tenant, name="parent")["id"]
    _with_weights(settings, parent)
    # While the run lives, it is a source like any other.
    child = _create_from(http, tenant.headers, {"run_id": parent} | source)
    assert child.status_code == 201, child.text
    assert http.delete(f"/v1/runs/{parent}", headers=tenant.headers).status_code == 200
    runs_before = row_counts(settings, Run)

    r = _create_from(http, tenant.headers | {"Idempotency-Key": "from-deleted"}, {"run_id": parent} | source)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {
        "code": "not_found",
        "message": f"run {parent} not found (init_from.run_id)",
        "details": None,
    }
    # The same answer as a run that never existed, and no run stored (the key is free still).
    unknown = _create_from(http, tenant.headers, {"run_id": "run_000000000000"} | source)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["message"] == "run run_000000000000 not found (init_from.run_id)"
    assert row_counts(settings, Run) == runs_before
    fresh = http.post(
        "/v1/runs", json={"name": "fresh"}, headers=tenant.headers | {"Idempotency-Key": "from-deleted"}
    )
    assert fresh.status_code == 201, fresh.text
