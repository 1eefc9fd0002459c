"""Non-finite numbers in the Tinker routes' JSON, both ways (app/tinker/finite.py).

Python's json module parses the literals NaN, Infinity and -Infinity, and 1e999 as an infinity;
pydantic's float fields take them. In: a client's number that must be finite (adam_params,
sampling_params) is a 422 naming the field, and nothing is stored. Back from the pool: a result
holding one fails its future alone (on Postgres the whole post was a 422, every other result in it
lost; on SQLite it was stored, and each poll of the future a 500, which the SDK retries at once, for
ever), and what the client polls is strict JSON.
"""

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from tinker.proto.response_conv import deserialize_forward_backward_output

from app.tinker.finite import FINITE, first_non_finite
from app.tinker.models import TinkerFuture
from app.tinker.work import non_finite_field
from contracts.tinker_work import ManualResult, SampledSequence
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.test_tinker_sampling import _base_sampler
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model

SPELLINGS = ("NaN", "Infinity", "-Infinity", "1e999", "-1e999")
"""What a non-finite number looks like in a body Python's json module parses."""
JSON = {"Content-Type": "application/json"}


def _raw(body: dict[str, Any], spelling: str) -> bytes:
    """`body` as JSON with every "BAD" string written as `spelling` (httpx refuses to write NaN)."""
    return json.dumps(body).replace('"BAD"', spelling).encode()


def _strict(content: bytes) -> Any:
    """`content` parsed as standard JSON: a NaN or Infinity literal is an error."""

    def refuse(literal: str) -> None:
        raise ValueError(f"not JSON: {literal}")

    return json.loads(content, parse_constant=refuse)


def _count(db: Session, tenant_id: str, kind: str) -> int:
    db.expire_all()
    n = db.scalar(select(func.count()).where(TinkerFuture.tenant_id == tenant_id, TinkerFuture.kind == kind))
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return n or 0


def _future(db: Session, request_id: str) -> TinkerFuture:
    db.expire_all()
    future = db.get_one(TinkerFuture, request_id)
    db.expunge(future)
    db.rollback()
    return future


def _refused_naming(r: Any, field: list[str]) -> None:
    """A 422 naming the body's `field`: its message by the field's path, its `loc` under "body"."""
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    assert error["message"] == f"{'.'.join(field)} {FINITE}"
    assert error["details"] == [{"loc": ["body", *field], "msg": FINITE, "type": "finite_number"}]


# --- in: what clients send ------------------------------------------------------------------


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_non_finite_adam_parameter_is_a_422_naming_it_and_stores_nothing(client, tenant, db, spelling):
    model_id, headers = _model(client, tenant)
    for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3, name: "BAD"}}
        r = client.post("/api/v1/optim_step", content=_raw(body, spelling), headers=headers | JSON)
        _refused_naming(r, ["adam_params", name])
    assert _count(db, tenant.id, "optim_step") == 0
    fine = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
    assert client.post("/api/v1/optim_step", json=fine, headers=headers).status_code == 200


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_a_non_finite_sampling_parameter_is_a_422_naming_it_and_stores_nothing(
    client: TestClient, tenant: TenantHandle, db: Session, spelling: str
) -> None:
    register(client)
    sampler_id = _base_sampler(client, tenant)
    headers = {"X-API-Key": "tml-" + tenant.key}
    for name in ("temperature", "top_p"):
        body = {
            "sampling_session_id": sampler_id,
            "seq_id": 0,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": 4, name: "BAD"},
        }
        r = client.post("/api/v1/asample", content=_raw(body, spelling), headers=headers | JSON)
        _refused_naming(r, ["sampling_params", name])
    assert _count(db, tenant.id, "sample") == 0


def test_non_finite_numbers_in_the_other_json_bodies_are_422s_naming_the_field(client, tenant, db):
    """Every other number the routes read is an integer (pydantic refuses a non-finite one) or
    user_metadata (app/tinker/schemas.py): a 422 that names the field, nothing stored."""
    model_id, headers = _model(client, tenant)
    session_id = model_id.split(":")[0]
    create = {"session_id": session_id, "model_seq_id": 1, "base_model": "loraloom-tiny"}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/api/v1/create_model", create | {"lora_config": {"rank": "BAD"}}, "rank"),
        (
            "/api/v1/create_model",
            create | {"model_seq_id": "BAD", "lora_config": {"rank": 4}},
            "model_seq_id",
        ),
        (
            "/api/v1/create_model",
            create | {"lora_config": {"rank": 4}, "user_metadata": {"x": "BAD"}},
            "user_metadata",
        ),
        ("/api/v1/create_session", {"user_metadata": {"x": ["BAD"]}}, "user_metadata"),
        ("/api/v1/optim_step", {"model_id": model_id, "seq_id": "BAD", "adam_params": {}}, "seq_id"),
        ("/api/v1/save_weights", {"model_id": model_id, "seq_id": "BAD"}, "seq_id"),
    ]
    for spelling in SPELLINGS:
        for path, body, field in cases:
            r = client.post(path, content=_raw(body, spelling), headers=headers | JSON)
            assert r.status_code == 422, (path, spelling, r.text)
            assert field in r.text, (path, spelling, r.text)
    assert _count(db, tenant.id, "create_model") == 1  # the first model's only
    assert _count(db, tenant.id, "optim_step") == _count(db, tenant.id, "save_weights") == 0


def test_the_finite_check_finds_the_path_of_the_first_non_finite_number():
    assert first_non_finite({"a": [1.0, 2, "x", None, True]}) is None
    assert first_non_finite({"a": [1.0, {"b": float("-inf")}], "c": float("nan")}) == ("a", "1", "b")
    assert first_non_finite(float("nan")) == ()


# --- back: what the pool reports -------------------------------------------------------------


def test_a_non_finite_number_in_any_field_of_a_result_is_found_and_named():
    nan, inf = float("nan"), float("inf")
    sequence = SampledSequence(tokens=[1, 2], logprobs=[-0.5, -1.0], stop_reason="stop")
    fine = ManualResult(
        request_id="r",
        logprobs=[[-1.0], [-2.0, -3.0]],
        elementwise_loss=[[1.0], [2.0, 3.0]],
        sequences=[sequence],
        prompt_logprobs=[None, -1.0],
        metrics={"loss": 1.5, "step": 3.0},
    )
    assert non_finite_field(fine) is None
    bad = sequence.model_copy(update={"logprobs": [-0.5, -inf]})
    for update, field in (
        ({"logprobs": [[-1.0], [-2.0, nan]]}, "logprobs of datum 1"),
        ({"elementwise_loss": [[inf]]}, "elementwise_loss of datum 0"),
        ({"sequences": [sequence, bad]}, "the logprobs of sequence 1"),
        ({"prompt_logprobs": [None, nan]}, "prompt_logprobs"),
        ({"metrics": {"loss": 1.0, "grad_norm": inf}}, "metrics['grad_norm']"),
    ):
        assert non_finite_field(fine.model_copy(update=update)) == field


def _claim(client: TestClient, pool_id: str) -> dict[str, str]:
    """kind (with the seq_id: `forward_backward1`) → request id of the claimed items."""
    r = client.post(
        "/v1/pool/manual/claim", json={"pool_id": pool_id, "max_items": 16}, headers=WORKER_HEADERS
    )
    assert r.status_code == 200, r.text
    return {
        f"{i['kind']}{i['seq_id'] if i['kind'] != 'sample' else ''}": i["request_id"]
        for i in r.json()["items"]
    }


@pytest.mark.parametrize("spelling", ("NaN", "-Infinity", "1e999"))
def test_a_result_with_a_non_finite_number_fails_its_future_alone_and_polls_answer_strict_json(
    client: TestClient, tenant: TenantHandle, db: Session, spelling: str
) -> None:
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    sampler_id = _base_sampler(client, tenant)
    for seq_id in (1, 2):
        r = client.post(
            "/api/v1/forward_backward",
            content=_fwdbwd_body(model_id, seq_id, [_datum([5, 6, 7])]),
            headers=headers | PROTOBUF,
        )
        assert r.status_code == 200, r.text
    step = {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}}
    assert client.post("/api/v1/optim_step", json=step, headers=headers).status_code == 200
    sample = {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 2},
    }
    assert client.post("/api/v1/asample", json=sample, headers=headers).status_code == 200
    ids = _claim(client, pool_id)
    assert sorted(ids) == ["forward_backward1", "forward_backward2", "optim_step3", "sample"]

    good, bad = ids["forward_backward1"], ids["forward_backward2"]
    results = [
        {
            "request_id": good,
            "logprobs": [[-1.0, -2.0]],
            "elementwise_loss": [[1.0, 2.0]],
            "metrics": {"loss:sum": 3.0},
        },
        {"request_id": bad, "logprobs": [[-1.0, "BAD"]], "metrics": {"loss:sum": 3.0}},
        {"request_id": ids["optim_step3"], "metrics": {"grad_norm": "BAD"}},
        {
            "request_id": ids["sample"],
            "sequences": [{"tokens": [9], "logprobs": ["BAD"], "stop_reason": "length"}],
        },
    ]
    posted = client.post(
        "/v1/pool/manual/results",
        content=_raw({"pool_id": pool_id, "results": results}, spelling),
        headers=WORKER_HEADERS | JSON,
    )
    assert posted.status_code == 200, posted.text
    assert posted.json() == {"recorded": 4}

    # The good result is kept and served as before.
    assert _future(db, good).status == "complete"
    answer = client.post("/api/v1/retrieve_future", json={"request_id": good}, headers=headers)
    assert answer.status_code == 200, answer.text
    assert list(deserialize_forward_backward_output(answer.content).loss_fn_outputs[0]["logprobs"].data) == [
        -1.0,
        -2.0,
    ]

    # Each bad one failed alone, nothing of it kept; its poll is strict JSON naming the field.
    for request_id, field in (
        (bad, "logprobs of datum 0"),
        (ids["optim_step3"], "metrics['grad_norm']"),
        (ids["sample"], "the logprobs of sequence 0"),
    ):
        future = _future(db, request_id)
        message = f"the pool's result holds a non-finite number (NaN or infinity) in {field}; it is not kept"
        assert (future.status, future.result, future.error, future.error_category) == (
            "failed",
            None,
            message,
            "server",
        )
        answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
        assert answer.status_code == 200, answer.text
        assert _strict(answer.content) == {"error": message, "category": "server"}
