"""The fast path of POST /v1/runs/{run_id}/batches (app/batches/lean_route.py): taken once the key
is in the key cache, it answers exactly as the documented route does, and every request it cannot
vouch for (a cache miss, a bad header) goes the documented way."""

import json
import re
from typing import Any

from fastapi.testclient import TestClient

from app.config import Settings
from app.key_cache import ApiKeyCache
from app.main import create_app
from tests.app.api import MSGPACK, batch_body, post_batch
from tests.app.factories import Seeded, batch_count, rollout_files, seed_run


def _session(settings: Settings, cache_seconds: float) -> list[tuple[int, Any]]:
    """One tenant's requests through a fresh app; each answer as (status, body without ids/times)."""
    app = create_app(settings)
    app.state.api_key_cache = ApiKeyCache(cache_seconds)
    seeded = seed_run(settings)
    other = seed_run(settings)
    answers = []
    with TestClient(app) as client:

        def record(resp: Any) -> None:
            text = resp.text.replace(seeded.run_id, "RUN").replace(other.run_id, "OTHER")
            body = json.loads(text)
            if "id" in body:  # ids and times differ between the two apps; their form may not
                body["id"] = type(body["id"]).__name__
                body["created_at"] = re.sub(r"\d", "9", body["created_at"])
            if "error" in body and body["error"]["details"] and isinstance(body["error"]["details"], dict):
                body["error"]["details"].pop("batch_id", None)
            answers.append((resp.status_code, body))

        record(post_batch(client, seeded, batch_body(3, seed=1), key="k1"))  # cache miss: documented
        record(post_batch(client, seeded, batch_body(2, seed=2), msgpack=True, key="k2"))
        record(post_batch(client, seeded, batch_body(2, seed=2), msgpack=True, key="k2"))  # replay
        record(post_batch(client, seeded, batch_body(2, seed=3), key="k2"))  # another body: 409
        record(post_batch(client, seeded, batch_body(1, seed=4, step=-1)))  # 422
        record(post_batch(client, seeded, {"examples": []}))  # 422
        # Another tenant's run, with this tenant's (cached) key: 404, nothing stored.
        record(post_batch(client, Seeded(seeded.tenant_id, seeded.secret, other.run_id), batch_body(1)))
        record(post_batch(client, seeded, batch_body(1, seed=5)))  # no key: a new batch
    return answers


def test_the_fast_path_answers_as_the_documented_route(settings, fast_calls):
    documented = _session(settings, cache_seconds=0.0)  # no cache: never the fast path
    assert fast_calls == []
    fast = _session(settings, cache_seconds=60.0)
    assert len(fast_calls) == 7  # all but the first request (the key was not cached yet)
    assert fast == documented
    statuses = [status for status, _ in fast]
    assert statuses == [201, 201, 200, 409, 422, 422, 404, 201]
    assert fast[3][1]["error"]["code"] == "idempotency_conflict"
    assert fast[6][1]["error"]["code"] == "not_found"


def test_headers_the_fast_path_cannot_vouch_for_go_the_documented_way(settings, client, fast_calls):
    seeded = seed_run(settings)
    assert post_batch(client, seeded, batch_body(1)).status_code == 201  # caches the key
    assert len(fast_calls) == 0
    url = f"/v1/runs/{seeded.run_id}/batches"
    r = client.post(url, content=b"{}", headers=seeded.headers | {"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = client.post(url, json=batch_body(1), headers=seeded.headers | {"Idempotency-Key": "k" * 129})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    r = client.post(url, json=batch_body(1), headers={"Authorization": "Bearer llk_unknown"})
    assert r.status_code == 401
    r = client.post(f"/v1/runs/{'x' * 65}/batches", json=batch_body(1), headers=seeded.headers)
    assert r.status_code == 422
    assert fast_calls == []
    assert batch_count(settings) == 1 and len(rollout_files(settings)) == 1


def test_the_fast_path_counts_requests_in_flight(settings, fast_calls):
    app = create_app(settings.model_copy(update={"tenant_max_in_flight": 1}))
    seeded = seed_run(settings)
    with TestClient(app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201
        app.state.in_flight.acquire(seeded.tenant_id)  # another request of this tenant, in flight
        r = post_batch(client, seeded, batch_body(1, seed=1), msgpack=True)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["details"]["kind"] == "requests_in_flight"
        app.state.in_flight.release(seeded.tenant_id)
        assert post_batch(client, seeded, batch_body(1, seed=1), msgpack=True).status_code == 201
    assert len(fast_calls) == 1  # the last one (the 429 was answered before any database work)
    assert app.state.in_flight.in_flight(seeded.tenant_id) == 0  # released after each request


def test_pending_limits_in_the_insert_statement_refuse_and_store_nothing(settings, fast_calls):
    app = create_app(settings.model_copy(update={"run_max_pending_batches": 2}))
    seeded = seed_run(settings)
    with TestClient(app) as client:
        for seed in range(2):
            assert post_batch(client, seeded, batch_body(1, seed=seed)).status_code == 201
        r = client.post(
            f"/v1/runs/{seeded.run_id}/batches",
            content=b"",
            headers=seeded.headers | {"Content-Type": MSGPACK},
        )
        assert r.status_code == 422  # the body is checked before the limits
        r = post_batch(client, seeded, batch_body(1, seed=9), key="k")
        assert r.status_code == 429 and r.headers["Retry-After"] == "2"
        details = r.json()["error"]["details"]
        assert details["kind"] == "pending_batches" and details["pending_batches"] == 2
    assert fast_calls  # the refusals above came from the fast path
    assert batch_count(settings) == 2 and len(rollout_files(settings)) == 2  # the refused file is gone


def test_a_large_first_batch_takes_the_fast_path_once_the_guard_looked_its_key_up(settings, fast_calls):
    """A body the request guard looks the key up for (over its 64 KiB precheck) finds the key cached
    by that lookup: no documented handler, no second lookup (before, every such request after the
    cache entry expired took both)."""
    seeded = seed_run(settings)
    body = batch_body(400)
    assert len(json.dumps(body)) > 64 << 10
    app = create_app(settings)
    app.state.api_key_cache = ApiKeyCache(60.0)  # the default 2 s could expire within a slow first request
    with TestClient(app) as client:
        resp = post_batch(client, seeded, body)
        assert resp.status_code == 201, resp.text
        assert fast_calls == [seeded.run_id]
        small = post_batch(client, seeded, batch_body(1, seed=9))
        assert small.status_code == 201
        assert fast_calls == [seeded.run_id, seeded.run_id]
    assert batch_count(settings) == 2
