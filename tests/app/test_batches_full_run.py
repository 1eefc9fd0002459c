"""A malformed batch sent to a run marked full (its unclaimed batches at their limits) is told what is
wrong with it (422), not to come back later (429): a client told 429 retries, and the 429 of a full run
lasts until the pool claims its batches, so a batch that can never be stored was retried for as long."""

from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient

from app.batches import service as batches_service
from app.batches.models import Batch
from app.config import Settings
from app.main import create_app
from tests.app.api import TenantHandle, batch_body, create_run, new_tenant
from tests.app.factories import row_counts

ROUTES = [pytest.param(True, id="fast-path"), pytest.param(False, id="documented-route")]


def _malformed() -> dict[str, tuple[bytes, str, str]]:
    """name -> (body, content type, the field its 422 names)."""
    negative_id = batch_body(seed=3)
    negative_id["examples"][1]["completion_ids"][0] = -1
    no_advantage = batch_body(seed=4)
    del no_advantage["examples"][0]["advantage"]
    return {
        "token id below 0": (msgspec.json.encode(negative_id), "application/json", "completion_ids"),
        "as msgpack": (msgspec.msgpack.encode(negative_id), "application/msgpack", "completion_ids"),
        "no advantage": (msgspec.json.encode(no_advantage), "application/json", "advantage"),
        "not JSON": (b"{not json", "application/json", "body"),
        "empty": (b"", "application/json", "body"),
    }


@pytest.mark.parametrize("lean", ROUTES)
def test_a_malformed_batch_to_a_full_run_is_a_422_before_its_429(settings: Settings, lean: bool) -> None:
    # No key cache: the documented route answers every request (app/batches/lean_route.py).
    cache_seconds = settings.api_key_cache_seconds if lean else 0.0
    settings = settings.model_copy(
        update={"run_max_pending_batches": 1, "api_key_cache_seconds": cache_seconds}
    )
    with TestClient(create_app(settings)) as client:
        tenant: TenantHandle = new_tenant(client)
        run = create_run(client, tenant)
        url = f"/v1/runs/{run['id']}/batches"
        keyed = {**tenant.headers, "Idempotency-Key": "first"}

        def post(body: bytes, content_type: str = "application/json", **headers: str) -> Any:
            return client.post(
                url, content=body, headers={**tenant.headers, "Content-Type": content_type, **headers}
            )

        first = msgspec.json.encode(batch_body(seed=0))
        assert post(first, **{"Idempotency-Key": "first"}).status_code == 201
        assert post(msgspec.json.encode(batch_body(seed=1))).status_code == 429  # marks the run full
        assert batches_service.full_runs(client.app.state).get(run["id"]) is True  # type: ignore[attr-defined]

        for what, (body, content_type, field) in _malformed().items():
            r = post(body, content_type)
            assert r.status_code == 422, (what, r.text)
            error = r.json()["error"]
            assert error["code"] == "validation_error" and field in [d["field"] for d in error["details"]], (
                what,
                error,
            )
        assert row_counts(settings, Batch) == (1,)

        # A well-formed batch still meets the early 429, and a retry of the accepted one gets it back.
        refused = post(msgspec.json.encode(batch_body(seed=2)))
        assert refused.status_code == 429 and refused.json()["error"]["details"]["pending_batches"] == 1
        replay = client.post(url, content=first, headers={**keyed, "Content-Type": "application/json"})
        assert replay.status_code == 200, replay.text
        assert row_counts(settings, Batch) == (1,)


def test_a_run_that_left_keeps_its_409_before_a_malformed_bodys_422(settings: Settings) -> None:
    """Only a full run checks the body first: a run that left will take no batch, whatever it holds.
    (The run read fresh: one from the route's cache may be up to `ingest_run_cache_seconds` old.)"""
    settings = settings.model_copy(update={"run_max_pending_batches": 1, "ingest_run_cache_seconds": 0.0})
    with TestClient(create_app(settings)) as client:
        tenant = new_tenant(client)
        run = create_run(client, tenant)
        url = f"/v1/runs/{run['id']}/batches"
        assert client.post(url, json=batch_body(seed=0), headers=tenant.headers).status_code == 201
        assert client.post(url, json=batch_body(seed=1), headers=tenant.headers).status_code == 429
        evicted = client.post(f"/v1/runs/{run['id']}/evict", json={"reason": "done"}, headers=tenant.headers)
        assert evicted.status_code == 200, evicted.text
        body: dict[str, Any] = batch_body(seed=2)
        body["examples"][0]["completion_ids"][0] = -1
        r = client.post(url, json=body, headers=tenant.headers)
        assert r.status_code == 409 and r.json()["error"]["code"] == "run_evicted", r.text
