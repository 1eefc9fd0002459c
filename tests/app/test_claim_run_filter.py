"""`ClaimIn.run_ids`: a pool whose buffer is full claims for its runs that have too little buffered,
and only theirs, so another run's flood stays queued at the service (a probe: one tenant's 4096-sample
batch held every other tenant's batches pending for as long as it trained). The filter keeps the
claim's fairness and leases; bad ids are a 422 in the uniform body, and nothing is leased."""

from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from contracts.pool_api import MAX_CLAIM_RUNS
from tests.app.api import WORKER_HEADERS, batch_body, claim, post_batch
from tests.app.factories import add_pool, batch_states, seed_run
from trainer_core.service_client import PoolServiceClient


def _claim(client: TestClient, body: dict[str, Any]) -> Any:
    return client.post("/v1/pool/batches/claim", json=body, headers=WORKER_HEADERS)


def test_claim_with_run_ids_leases_only_those_runs_batches(settings: Settings, client: TestClient) -> None:
    pool_id = add_pool(settings)
    flood, quiet, third = seed_run(settings), seed_run(settings), seed_run(settings)
    flood_ids = [post_batch(client, flood, batch_body(1, seed=i)).json()["id"] for i in range(4)]
    quiet_ids = [post_batch(client, quiet, batch_body(1, seed=10 + i)).json()["id"] for i in range(2)]
    third_id = post_batch(client, third, batch_body(1, seed=20)).json()["id"]

    r = _claim(client, {"pool_id": pool_id, "max_batches": 16, "run_ids": [quiet.run_id]})
    assert r.status_code == 200, r.text
    got = r.json()["batches"]
    assert [(b["id"], b["run_id"]) for b in got] == [(i, quiet.run_id) for i in quiet_ids]
    states = batch_states(settings)
    assert {i: states[i][0] for i in flood_ids + [third_id]} == dict.fromkeys(
        flood_ids + [third_id], "pending"
    )
    assert {i: states[i][:2] for i in quiet_ids} == dict.fromkeys(quiet_ids, ("claimed", pool_id))

    # Several runs: round-robin across the named ones, each run's in id order, as without the filter.
    r = _claim(client, {"pool_id": pool_id, "max_batches": 3, "run_ids": [third.run_id, flood.run_id]})
    assert [b["id"] for b in r.json()["batches"]] == sorted([flood_ids[0], third_id]) + [flood_ids[1]]
    # A run that is not the pool's (unknown here) claims nothing; null is any run, as before the filter.
    unknown = "run_" + "f" * 12
    assert _claim(client, {"pool_id": pool_id, "run_ids": [unknown]}).json()["batches"] == []
    r = _claim(client, {"pool_id": pool_id, "run_ids": None})
    assert [b["id"] for b in r.json()["batches"]] == flood_ids[2:]
    assert claim(client, pool_id)["batches"] == []


@pytest.mark.parametrize(
    ("run_ids", "loc", "kind"),
    [
        (["run_0123"], ["body", "run_ids", "0"], "string_pattern_mismatch"),
        (["pool_0123456789ab"], ["body", "run_ids", "0"], "string_pattern_mismatch"),
        (
            ["run_" + "0" * 11 + f"{i % 10}" for i in range(MAX_CLAIM_RUNS + 1)],
            ["body", "run_ids"],
            "too_long",
        ),
        ([], ["body", "run_ids"], "too_short"),
        ("run_000000000001", ["body", "run_ids"], "list_type"),
    ],
)
def test_bad_run_ids_are_a_uniform_422_and_lease_nothing(
    settings: Settings, client: TestClient, run_ids: Any, loc: list[str], kind: str
) -> None:
    pool_id = add_pool(settings)
    seeded = seed_run(settings)
    batch_id = post_batch(client, seeded, batch_body(1)).json()["id"]

    r = _claim(client, {"pool_id": pool_id, "max_batches": 4, "run_ids": run_ids})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    assert [(d["loc"], d["type"]) for d in error["details"]] == [(loc, kind)]
    assert batch_states(settings)[batch_id][0] == "pending"


def test_the_pools_client_claims_with_the_filter(settings: Settings, client: TestClient) -> None:
    """The pool's own client (`PoolServiceClient`, msgpack) against the service, with and without it."""
    pool_id = add_pool(settings)
    flood, quiet = seed_run(settings), seed_run(settings)
    flood_id = post_batch(client, flood, batch_body(2, seed=1)).json()["id"]
    quiet_id = post_batch(client, quiet, batch_body(2, seed=2)).json()["id"]
    pool = PoolServiceClient("http://testserver", "unused")
    pool._http = client  # type: ignore[assignment]  # a TestClient is an httpx.Client of the app
    client.headers.update(WORKER_HEADERS)
    pool.pool_id = pool_id

    got = pool.claim(8, run_ids=[quiet.run_id])
    assert [(b.id, b.run_id, b.num_samples) for b in got] == [(quiet_id, quiet.run_id, 2)]
    assert [b.id for b in pool.claim(8)] == [flood_id]
