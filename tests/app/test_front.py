"""The front layer (app/front.py): the hot route answered from it keeps what the layers it skips
gave (metrics by route template, the request id, the uniform error body, the app's exception
handlers), and the guards still run before it."""

import logging
from typing import Any

from fastapi.testclient import TestClient

from app.batches import lean_route
from app.config import Settings
from app.main import create_app
from app.telemetry.http import UNMATCHED
from tests.app.api import MSGPACK, batch_body, post_batch
from tests.app.factories import batch_count, seed_run
from tests.app.test_prometheus import scrape

ROUTE = "/v1/runs/{run_id}/batches"


def _requests(samples: dict, status: str, route: str = ROUTE) -> float:
    labels = (("method", "POST"), ("route", route), ("status", status))
    return samples.get(("loraloom_http_requests_total", labels), 0.0)


def test_the_hot_route_is_counted_under_its_template_with_a_request_id(settings: Settings, fast_calls):
    app = create_app(settings)
    seeded = seed_run(settings)
    with TestClient(app) as client:
        first = post_batch(client, seeded, batch_body(1))  # the documented handler (key not cached)
        second = post_batch(client, seeded, batch_body(1, seed=1), msgpack=True)  # the fast path
        missing = client.post(
            "/v1/runs/run_000000000000/batches",
            content=b"\x80",
            headers=seeded.headers | {"Content-Type": MSGPACK},
        )
        _, samples = scrape(client)
    assert first.status_code == second.status_code == 201
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert len(fast_calls) == 2  # the 201 and the 404 came from the fast path
    ids = {r.headers["x-request-id"] for r in (first, second, missing)}
    assert len(ids) == 3 and all(len(i) == 32 for i in ids)
    assert _requests(samples, "201") == 2 and _requests(samples, "404") == 1
    assert "content-security-policy" not in second.headers  # the dashboard's headers are its own


def test_a_bug_on_the_hot_route_is_a_uniform_500(settings: Settings, monkeypatch, caplog):
    app = create_app(settings)
    seeded = seed_run(settings)
    with TestClient(app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201  # caches the key

        def broken(*_args: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(lean_route, "_submit_in_thread", broken)
        with caplog.at_level(logging.ERROR, logger="loraloom"):
            r = post_batch(client, seeded, batch_body(1, seed=1))
        _, samples = scrape(client)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    request_id = r.headers["x-request-id"]
    assert r.json()["error"] == {
        "code": "internal_error",
        "message": f"internal error; request id {request_id}",
        "details": {"request_id": request_id},
    }
    assert any(request_id in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert _requests(samples, "500") == 1
    assert batch_count(settings) == 1


def test_the_guards_run_before_the_hot_route(settings: Settings, fast_calls):
    app = create_app(settings.model_copy(update={"max_body_bytes": 1000}))
    seeded = seed_run(settings)
    with TestClient(app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201  # caches the key
        url = f"/v1/runs/{seeded.run_id}/batches"
        r = client.post(url, content=b"\x00" * 2000, headers=seeded.headers | {"Content-Type": MSGPACK})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        r = client.post(url, content=b'{"a": "\\u0000"}', headers=seeded.headers)
        assert r.status_code == 422 and r.json()["error"]["details"][0]["type"] == "nul_character"
        r = client.post(url + "?x=%00", json=batch_body(1), headers=seeded.headers)
        assert r.status_code == 422 and r.json()["error"]["details"][0]["type"] == "nul_character"
        _, samples = scrape(client)
    assert fast_calls == []
    # Refused before any route matched: counted, as unmatched (as before the layers were one).
    assert _requests(samples, "413", UNMATCHED) == 1 and _requests(samples, "422", UNMATCHED) == 2
    assert batch_count(settings) == 1
