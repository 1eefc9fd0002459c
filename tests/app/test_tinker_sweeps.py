"""The sweeper and Tinker futures that can no longer be served: the work of a run that has left
fails at the next sweep without anyone polling it (and is then purged by the retention), and a
base-model sample that no pool claims fails after settings.tinker_base_sample_wait_seconds."""

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app import sweeper
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.tinker.models import TinkerFuture
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.test_tinker_sampling import _base_sampler, _sample_body
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model

pytestmark = pytest.mark.postgres_only


@pytest.fixture
def factory(settings: Settings):
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def _futures(db: Session, ids: list[str]) -> dict[str, TinkerFuture]:
    db.expire_all()
    return {f.id: f for f in db.scalars(select(TinkerFuture).where(TinkerFuture.id.in_(ids)))}


@pytest.mark.parametrize("leaves_by", ["evict", "delete"])
def test_the_work_of_a_run_that_left_fails_at_the_next_sweep_and_is_then_purged(
    client: TestClient, tenant: TenantHandle, db: Session, settings: Settings, factory, leaves_by: str
) -> None:
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    submitted = []
    for seq_id in (1, 2):
        r = client.post(
            "/api/v1/forward_backward",
            content=_fwdbwd_body(model_id, seq_id, [_datum([1, 2, 3])]),
            headers=headers | PROTOBUF,
        )
        assert r.status_code == 200, r.text
        submitted.append(r.json()["request_id"])
    # The first one is in the pool's hands (running), the second still pending.
    claimed = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 1}, headers=WORKER_HEADERS
    ).json()["items"]
    assert [i["request_id"] for i in claimed] == submitted[:1]
    run_id = client.get("/v1/runs", headers=tenant.headers).json()["items"][0]["id"]
    if leaves_by == "evict":
        left = client.post(f"/v1/runs/{run_id}/evict", json={"reason": "done here"}, headers=tenant.headers)
        why = "evicted: done here"
    else:
        left = client.delete(f"/v1/runs/{run_id}", headers=tenant.headers)
        why = "deleted"
    assert left.status_code in (200, 204), left.text

    now = datetime.now(UTC)
    result = sweeper.sweep_once(factory, settings=settings, now=now)
    assert result.errors == [] and result.failed_futures == 2
    # Nobody polled them: the sweep failed them, with the reason.
    futures = _futures(db, submitted)
    assert [(futures[i].status, futures[i].error) for i in submitted] == [
        ("failed", f"the model's run {run_id} left ({why})")
    ] * 2
    assert all(f.request is None for f in futures.values())
    # The pool's late result for the one it held is ignored.
    late = {"pool_id": pool_id, "results": [{"request_id": submitted[0], "metrics": {"loss:sum": 1.0}}]}
    assert client.post("/v1/pool/manual/results", json=late, headers=WORKER_HEADERS).json() == {"recorded": 0}

    # Done futures like any other: purged once the retention has passed.
    later = now + timedelta(seconds=settings.tinker_future_ttl_seconds + 1)
    result = sweeper.sweep_once(factory, settings=settings, now=later)
    assert result.errors == [] and result.purged_futures >= 2
    assert _futures(db, submitted) == {}


def test_a_base_model_sample_no_pool_claims_fails_after_the_wait(
    client: TestClient, tenant: TenantHandle, db: Session, settings: Settings, factory
) -> None:
    register(client)
    sampler_id = _base_sampler(client, tenant)
    r = client.post(
        "/api/v1/asample",
        json=_sample_body(sampler_id, [5, 6, 7]),
        headers={"X-API-Key": "tml-" + tenant.key},
    )
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]
    wait = settings.tinker_base_sample_wait_seconds
    created = _futures(db, [request_id])[request_id].created_at

    # Just within the wait (the pool never claimed it): still pending.
    result = sweeper.sweep_once(factory, settings=settings, now=created + timedelta(seconds=wait - 1))
    assert result.errors == [] and result.failed_futures == 0
    assert _futures(db, [request_id])[request_id].status == "pending"

    result = sweeper.sweep_once(factory, settings=settings, now=created + timedelta(seconds=wait + 1))
    assert result.errors == [] and result.failed_futures == 1
    future = _futures(db, [request_id])[request_id]
    assert future.status == "failed" and future.request is None
    assert future.error is not None and future.error.startswith(
        f"no pool serving loraloom-tiny claimed this sample request within {wait:g} s"
    )
    answer = client.post(
        "/api/v1/retrieve_future",
        json={"request_id": request_id},
        headers={"X-API-Key": "tml-" + tenant.key},
    )
    assert answer.json() == {"error": future.error, "category": "user"}
