"""The service's side of Tinker work after a pool crash, in-process: a dead or replaced pool's
claims return to pending and its late results are refused; the next pool gets the step's
delivered forward_backwards to replay (once, their results untouched) until the step's optim_step
is recorded; done futures are purged after the retention and then answer a clear 404."""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session
from tinker.proto.response_conv import deserialize_forward_backward_output

from app import sweeper
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.pools.models import Pool
from app.tinker.models import TinkerFuture
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model, _retrieve

pytestmark = pytest.mark.postgres_only


@pytest.fixture
def factory(settings: Settings):
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def _claim(client: TestClient, pool_id: str) -> list[dict[str, Any]]:
    r = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def _report(client: TestClient, pool_id: str, results: list[dict[str, Any]]) -> Any:
    return client.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
    )


def _fb(client: TestClient, model_id: str, seq_id: int, headers: dict[str, str]) -> str:
    r = client.post(
        "/api/v1/forward_backward",
        content=_fwdbwd_body(model_id, seq_id, [_datum([1, 2, 3 + seq_id])]),
        headers=headers | PROTOBUF,
    )
    assert r.status_code == 200, r.text
    request_id: str = r.json()["request_id"]
    return request_id


def _step(client: TestClient, model_id: str, seq_id: int, headers: dict[str, str]) -> str:
    r = client.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.01}},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    request_id: str = r.json()["request_id"]
    return request_id


def _logprobs(client: TestClient, request_id: str, headers: dict[str, str]) -> list[list[float]]:
    output = deserialize_forward_backward_output(_retrieve(client, request_id, headers).content)
    return [o["logprobs"].tolist() for o in output.loss_fn_outputs]


def _future(db: Session, request_id: str) -> TinkerFuture:
    db.expire_all()
    return db.get_one(TinkerFuture, request_id)


def test_a_replaced_pools_step_is_replayed_by_the_next_pool_and_its_late_results_refused(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    first_pool = register(client)
    model_id, headers = _model(client, tenant)
    fb1 = _fb(client, model_id, 1, headers)
    [item] = _claim(client, first_pool)
    delivered = {"request_id": fb1, "logprobs": [[-1.0, -2.0]], "metrics": {"loss:sum": 3.0}}
    assert _report(client, first_pool, [delivered]).json() == {"recorded": 1}
    fb2, step = _fb(client, model_id, 2, headers), _step(client, model_id, 3, headers)
    assert [i["request_id"] for i in _claim(client, first_pool)] == [fb2, step]
    # The first pool still holds its gradient: nothing to replay for it.
    assert _future(db, fb1).pool_id == first_pool

    # The pool restarts: it registers again, which replaces the old registration.
    second_pool = register(client)
    assert (_future(db, fb2).status, _future(db, fb2).pool_id) == ("pending", None)
    late = _report(client, first_pool, [{"request_id": fb2, "logprobs": [[-9.0, -9.0]]}])
    assert late.status_code == 409 and late.json()["error"]["code"] == "pool_stopped", late.text
    assert _future(db, fb2).status == "pending"

    # The new pool: fb1 to replay (its gradient was lost), then the pending rest, in seq_id order.
    items = _claim(client, second_pool)
    assert [(i["request_id"], i["replay"]) for i in items] == [(fb1, True), (fb2, False), (step, False)]
    assert items[0]["data"] == item["data"]
    # A claim before the replay was reported (the run not admitted yet): released, replayed later.
    assert _report(client, second_pool, [{"request_id": fb1, "release": True}]).json() == {"recorded": 0}
    assert _future(db, fb1).status == "complete"
    assert [i["request_id"] for i in _claim(client, second_pool)] == [fb1]
    assert _report(client, second_pool, [{"request_id": fb1, "replayed": True}]).json() == {"recorded": 0}
    assert _claim(client, second_pool) == []
    # The delivered result never changes.
    assert _logprobs(client, fb1, headers) == [[-1.0, -2.0]]

    results: list[dict[str, Any]] = [
        {"request_id": fb2, "logprobs": [[-0.5, -0.25]], "metrics": {"loss:sum": 0.75}},
        {"request_id": step, "metrics": {"grad_norm": 0.5, "step": 1.0}},
    ]
    assert _report(client, second_pool, results).json() == {"recorded": 2}
    assert _logprobs(client, fb2, headers) == [[-0.5, -0.25]]
    # The step is checkpointed: its requests are dropped, and a third pool replays nothing.
    assert _future(db, fb1).request is None and _future(db, fb2).request is None
    third_pool = register(client)
    assert _claim(client, third_pool) == []


def test_a_pool_declared_dead_returns_its_claims(
    client: TestClient, tenant: TenantHandle, db: Session, settings: Settings, factory
) -> None:
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    fb = _fb(client, model_id, 1, headers)
    assert [i["request_id"] for i in _claim(client, pool_id)] == [fb]
    assert _future(db, fb).status == "running"
    later = datetime.now(UTC) + timedelta(seconds=settings.pool_timeout_seconds + 1)
    assert sweeper.sweep_once(factory, settings=settings, now=later).dead_pools == [pool_id]
    assert (_future(db, fb).status, _future(db, fb).pool_id) == ("pending", None)
    assert _retrieve(client, fb, headers).json()["type"] == "try_again"
    assert _report(client, pool_id, [{"request_id": fb, "logprobs": [[-1.0, -1.0]]}]).status_code == 409
    assert [i["request_id"] for i in _claim(client, register(client))] == [fb]


def test_done_futures_are_purged_after_the_retention_and_then_answer_404(
    client: TestClient, tenant: TenantHandle, db: Session, settings: Settings, factory
) -> None:
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    fb1, step = _fb(client, model_id, 1, headers), _step(client, model_id, 2, headers)
    fb3 = _fb(client, model_id, 3, headers)
    _claim(client, pool_id)
    done: list[dict[str, Any]] = [
        {"request_id": fb1, "logprobs": [[-1.0, -1.0]]},
        {"request_id": step, "metrics": {"step": 1.0}},
    ]
    assert _report(client, pool_id, done).json() == {"recorded": 2}
    _claim(client, pool_id)
    assert _report(client, pool_id, [{"request_id": fb3, "logprobs": [[-1.0, -1.0]]}]).json() == {
        "recorded": 1
    }
    with factory() as s:  # the create_model future: the model's record
        create = s.query(TinkerFuture).filter_by(model_id=model_id, kind="create_model").one().id

    # Within the retention: nothing goes.
    assert sweeper.sweep_once(factory, settings=settings).purged_futures == 0
    # Past it (moved by a retention of 0 and a clock a second on): the done results go; the
    # model's record stays, and so does fb3, whose request rebuilds the step in progress.
    expired = settings.model_copy(update={"tinker_future_ttl_seconds": 0.0})
    later = datetime.now(UTC) + timedelta(seconds=1)
    assert sweeper.sweep_once(factory, settings=expired, now=later).purged_futures == 2
    for gone in (fb1, step):
        r = client.post("/api/v1/retrieve_future", json={"request_id": gone}, headers=headers)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "not_found"
        assert "LORALOOM_TINKER_FUTURE_TTL_SECONDS" in r.json()["error"]["message"]
    assert _logprobs(client, fb3, headers) == [[-1.0, -1.0]]
    assert _future(db, create).status == "complete"
    db.expire_all()
    assert db.get_one(Pool, pool_id).status == "alive"
