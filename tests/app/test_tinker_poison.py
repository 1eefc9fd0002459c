"""A Tinker request that stops every pool that runs it (probe 2, finding 1: a sample request crashed
the pool, and the restarted pool claimed it again and died within a second, forever) fails once it
has lost `MAX_LOST_LEASES` leases, with an error that says why; a request that lost fewer goes back
to pending as before. And the door: a tiny positive sampling temperature is accepted (the pool samples
it greedily), a meaningless one is refused with a 422 that names the field. On both databases."""

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app import sweeper
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.tinker.leases import MAX_LOST_LEASES
from app.tinker.models import TinkerFuture
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.test_tinker_sampling import _base_sampler, _headers
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model


def _asample(client: TestClient, tenant: TenantHandle, sampler_id: str, params: dict[str, Any]) -> Any:
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 4, **params},
    }
    # Raw JSON: NaN is sent as Python's json writes it (httpx refuses to).
    content = json.dumps(body).encode()
    return client.post(
        "/api/v1/asample", content=content, headers=_headers(tenant) | {"Content-Type": "application/json"}
    )


def _claim(client: TestClient, pool_id: str) -> list[str]:
    r = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 16}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text
    return sorted(item["request_id"] for item in r.json()["items"])


def _future(db: Session, request_id: str) -> TinkerFuture:
    """The future as stored now, detached; the read's transaction ended (on SQLite it would hold
    a lock that every write of the service waits on)."""
    db.expire_all()
    future = db.get_one(TinkerFuture, request_id)
    db.expunge(future)
    db.rollback()
    return future


def test_a_request_whose_pools_all_stop_fails_after_max_lost_leases(
    client: TestClient, tenant: TenantHandle, other_tenant: TenantHandle, db: Session, settings: Settings
) -> None:
    assert MAX_LOST_LEASES == 2
    first = register(client)
    sampler_id = _base_sampler(client, tenant)
    poison = _asample(client, tenant, sampler_id, {"temperature": 1e-40}).json()["request_id"]
    model_id, model_headers = _model(client, other_tenant)
    fb = client.post(
        "/api/v1/forward_backward",
        content=_fwdbwd_body(model_id, 1, [_datum([1, 2, 3])]),
        headers=model_headers | PROTOBUF,
    ).json()["request_id"]
    assert _claim(client, first) == sorted([poison, fb])

    # The pool dies holding both; the restarted pool registers (replacing it): both are pending again.
    second = register(client)
    for request_id in (poison, fb):
        future = _future(db, request_id)
        assert (future.status, future.pool_id, future.lost_leases) == ("pending", None, 1)
    assert _claim(client, second) == sorted([poison, fb])
    # A request claimed for the first time by the restarted pool.
    later = client.post(
        "/api/v1/forward_backward",
        content=_fwdbwd_body(model_id, 2, [_datum([1, 2, 4])]),
        headers=model_headers | PROTOBUF,
    ).json()["request_id"]
    assert _claim(client, second) == [later]
    # A request the pool hands back unrun (its run not admitted yet) has lost no lease.
    released = client.post(
        "/v1/pool/manual/results",
        json={"pool_id": second, "results": [{"request_id": fb, "release": True}]},
        headers=WORKER_HEADERS,
    )
    assert released.json() == {"recorded": 0}
    assert (_future(db, fb).status, _future(db, fb).lost_leases) == ("pending", 1)
    assert _claim(client, second) == [fb]

    # The restarted pool dies too (declared dead by the sweeper this time): the two it held twice fail,
    # with the reason; the one it held once goes back to pending.
    engine = make_engine(settings.database_url)
    try:
        now = datetime.now(UTC) + timedelta(seconds=settings.pool_timeout_seconds + 1)
        swept = sweeper.sweep_once(make_session_factory(engine), settings=settings, now=now)
    finally:
        engine.dispose()
    assert swept.dead_pools == [second]
    for request_id, who in ((poison, tenant), (fb, other_tenant)):
        future = _future(db, request_id)
        assert (future.status, future.lost_leases, future.error_category) == ("failed", 2, "server")
        assert future.request is None and future.completed_at is not None and future.pool_id is None
        answer = client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id}, headers=_headers(who)
        )
        assert answer.status_code == 200
        assert answer.json()["category"] == "server"
        assert "the worker pool stopped 2 times while running this request" in answer.json()["error"]
    assert (_future(db, later).status, _future(db, later).lost_leases) == ("pending", 1)

    # A third pool gets only the request that still has a lease to lose, and may answer it.
    third = register(client)
    assert _claim(client, third) == [later]
    done = client.post(
        "/v1/pool/manual/results",
        json={"pool_id": third, "results": [{"request_id": later, "logprobs": [[-1.0, -1.0]]}]},
        headers=WORKER_HEADERS,
    )
    assert done.json() == {"recorded": 1}
    assert _future(db, later).status == "complete"


def test_a_tiny_temperature_is_accepted_and_meaningless_ones_are_refused_naming_the_field(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    register(client)
    sampler_id = _base_sampler(client, tenant)
    for temperature in (0.0, 1e-40, 5e-324, 0.7, 100.0):
        r = _asample(client, tenant, sampler_id, {"temperature": temperature})
        assert r.status_code == 200, (temperature, r.text)
        stored = _future(db, r.json()["request_id"]).request
        assert stored is not None and stored["sampling"]["temperature"] == temperature
    refused: tuple[object, ...] = (-1.0, -1e-40, 100.5, float("inf"), float("nan"), "hot", None)
    for bad in refused:
        r = _asample(client, tenant, sampler_id, {"temperature": bad})
        assert r.status_code == 422, (bad, r.text)
        error = r.json()["error"]
        assert any("temperature" in detail["loc"] for detail in error["details"]), (bad, error)
