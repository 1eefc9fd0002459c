"""The service's side of Tinker work, in-process: our protobuf codec against the SDK's own
encoder and decoder, idempotent submissions, the "try again" answer, the pool's claim up to the
optim_step boundary, bad input stored nowhere, and a run that leaves failing its futures."""

from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, inspect, select
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from app.tinker import service as tinker_service
from app.tinker.models import TinkerFuture
from app.tinker.proto import decode_forward_backward_request, encode_forward_backward_output
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.tinker_calls import new_model, tinker_headers

pytestmark = pytest.mark.postgres_only


def _datum(tokens: list[int], **inputs: Any) -> types.Datum:
    # The SDK converts plain lists to TensorData.
    loss_fn_inputs: dict[str, Any] = {"target_tokens": tokens[1:], **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_fn_inputs)


def _fwdbwd_body(
    model_id: str, seq_id: int, data: list[types.Datum], loss_fn: types.LossFnType = "cross_entropy"
) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_codec_reads_the_sdks_requests_and_writes_what_the_sdk_reads():
    datum = _datum([5, 6, 7, 300_000], weights=[0.0, 1.0, 0.5], advantages=[1.0, -2.0, 3.0])
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum, _datum([1, 2])], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="ses_0123456789ab:train:3",
        seq_id=42,
    )
    message = forward_backward_request_to_proto(request)
    message.forward_only = True
    decoded = decode_forward_backward_request(message.SerializeToString())
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn, decoded.forward_only) == (
        "ses_0123456789ab:train:3",
        42,
        "ppo",
        True,
    )
    assert decoded.loss_fn_config == {"clip_low_threshold": 0.7}
    assert [d.tokens for d in decoded.data] == [[5, 6, 7], [1]]
    first = decoded.data[0].loss_fn_inputs
    assert first["target_tokens"].data.tolist() == [6, 7, 300_000]
    assert first["weights"].data.tolist() == [0.0, 1.0, 0.5]
    assert first["advantages"].shape == [3]

    body = encode_forward_backward_output(
        outputs={"logprobs": [np.array([-1.5, -2.0]), np.array([-0.25])]},
        num_datums=2,
        metrics={"loss:sum": 3.75},
    )
    output = deserialize_forward_backward_output(body)
    assert output.metrics == {"loss:sum": 3.75}
    assert [o["logprobs"].tolist() for o in output.loss_fn_outputs] == [[-1.5, -2.0], [-0.25]]


def _model(client: TestClient, tenant: TenantHandle) -> tuple[str, dict[str, str]]:
    return new_model(client, tenant), tinker_headers(tenant)


# What the SDK sends with a protobuf body (tinker/resources/training.py).
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _retrieve(client: TestClient, request_id: str, headers: dict[str, str]) -> Any:
    r = client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
    assert r.status_code == 200, r.text
    return r


def _stored(db) -> int:
    db.expire_all()
    return int(
        db.scalar(select(func.count()).select_from(TinkerFuture).where(TinkerFuture.kind != "create_model"))
    )


def test_work_is_stored_once_answered_try_again_and_claimed_up_to_the_step(client, tenant, db):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    data = [_datum([1, 2, 3, 4], weights=[1.0, 1.0, 1.0])]
    fb = client.post(
        "/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1, data), headers=headers | PROTOBUF
    )
    again = client.post(
        "/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1, data), headers=headers | PROTOBUF
    )
    assert fb.status_code == 200, fb.text
    assert again.json()["request_id"] == fb.json()["request_id"]  # the SDK's retry: applied once
    step = client.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.01}},
        headers=headers,
    )
    after = client.post(
        "/api/v1/forward_backward", content=_fwdbwd_body(model_id, 3, data), headers=headers | PROTOBUF
    )
    assert _stored(db) == 3

    # Not done yet: the SDK's "try again" (it polls again).
    assert _retrieve(client, fb.json()["request_id"], headers).json() == {
        "type": "try_again",
        "request_id": fb.json()["request_id"],
        "queue_state": "active",
    }

    # The pool gets the work in seq_id order up to and including the optim_step; the rest later.
    claim = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    items = claim.json()["items"]
    assert [(i["kind"], i["seq_id"]) for i in items] == [("forward_backward", 1), ("optim_step", 2)]
    assert items[0]["data"][0] == {
        "tokens": [1, 2, 3],
        "target_tokens": [2, 3, 4],
        "weights": [1.0, 1.0, 1.0],
        "logprobs": None,
        "advantages": None,
    }
    assert items[1]["adam"]["learning_rate"] == 0.01 and items[1]["adam"]["beta2"] == 0.95
    results = [
        {
            "request_id": items[0]["request_id"],
            "logprobs": [[-1.0, -2.0, -0.5]],
            "metrics": {"loss:sum": 3.5},
        },
        {"request_id": items[1]["request_id"], "metrics": {"grad_norm": 0.1}},
    ]
    posted = client.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
    )
    assert posted.json() == {"recorded": 2}

    done = _retrieve(client, fb.json()["request_id"], headers)
    assert done.headers["content-type"] == "application/x-protobuf"
    output = deserialize_forward_backward_output(done.content)
    assert output.metrics == {"loss:sum": 3.5}
    assert output.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0, -0.5]
    assert _retrieve(client, step.json()["request_id"], headers).json() == {"metrics": {"grad_norm": 0.1}}

    next_claim = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert [i["request_id"] for i in next_claim.json()["items"]] == [after.json()["request_id"]]


def test_a_long_poll_checks_a_pending_future_a_few_times_without_its_request(client, tenant, monkeypatch):
    """retrieve_future on a pending forward_backward read the whole stored request (up to ~20 MB of
    JSON) 40 times per 2 s long poll: a hostile tenant's hundred pollers held every tenant's requests
    for seconds. Checks now back off (8 per long poll) and leave the request unloaded."""
    register(client)
    model_id, headers = _model(client, tenant)
    data = [_datum(list(range(1, 200)), weights=[1.0] * 198)]
    fb = client.post(
        "/api/v1/forward_backward", content=_fwdbwd_body(model_id, 1, data), headers=headers | PROTOBUF
    )
    unloaded: list[bool] = []
    real_get = tinker_service.get_future

    def get_future(session, **kwargs):
        future = real_get(session, **kwargs)
        unloaded.append("request" in inspect(future).unloaded)
        return future

    monkeypatch.setattr(tinker_service, "get_future", get_future)
    assert _retrieve(client, fb.json()["request_id"], headers).json()["type"] == "try_again"
    # 40 before; now the backed-off checks and one read for the try-again's queue state
    assert 4 <= len(unloaded) <= 10, len(unloaded)
    assert all(unloaded)


def test_bad_input_stores_nothing_and_other_tenants_get_404(client, tenant, other_tenant, db):
    register(client)
    model_id, headers = _model(client, tenant)
    bad = [
        b"\x0a\xff\xff",  # truncated
        _fwdbwd_body(model_id, 1, [_datum([1, 2, 300])]),  # outside the pool's vocabulary
        _fwdbwd_body(model_id, 1, [_datum([1, 2, 3])], loss_fn="importance_sampling"),  # no advantages
        _fwdbwd_body(model_id, 1, [_datum([1, 2, 3], weights=[1.0])]),  # misaligned weights
    ]
    for body in bad:
        r = client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)
        assert r.status_code == 422, r.text
    other = {"X-API-Key": "tml-" + other_tenant.key}
    r = client.post(
        "/api/v1/forward_backward",
        content=_fwdbwd_body(model_id, 1, [_datum([1, 2])]),
        headers=other | PROTOBUF,
    )
    assert r.status_code == 404
    assert _stored(db) == 0


def test_a_run_that_leaves_fails_its_pending_futures(client, tenant):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    fb = client.post(
        "/api/v1/forward_backward",
        content=_fwdbwd_body(model_id, 1, [_datum([1, 2, 3])]),
        headers=headers | PROTOBUF,
    )
    run_id = client.get("/v1/runs", headers=tenant.headers).json()["items"][0]["id"]
    assert (
        client.post(
            f"/v1/runs/{run_id}/evict", json={"reason": "done here"}, headers=tenant.headers
        ).status_code
        == 200
    )
    assert _retrieve(client, fb.json()["request_id"], headers).json() == {
        "error": f"the model's run {run_id} left (evicted: done here)",
        "category": "user",
    }
    claim = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
    assert claim.json()["items"] == []
    refused = client.post(
        "/api/v1/forward_backward",
        content=_fwdbwd_body(model_id, 2, [_datum([1, 2])]),
        headers=headers | PROTOBUF,
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "run_not_active"


def test_work_of_a_run_the_pool_has_not_admitted_yet_is_released_and_claimed_again(client, tenant):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    fb = client.post(
        "/api/v1/forward_backward",
        content=_fwdbwd_body(model_id, 1, [_datum([1, 2, 3])]),
        headers=headers | PROTOBUF,
    )
    first = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    assert [i["request_id"] for i in first] == [fb.json()["request_id"]]
    released = {"pool_id": pool_id, "results": [{"request_id": first[0]["request_id"], "release": True}]}
    assert client.post("/v1/pool/manual/results", json=released, headers=WORKER_HEADERS).json() == {
        "recorded": 0
    }
    assert _retrieve(client, fb.json()["request_id"], headers).json()["type"] == "try_again"
    again = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    assert again == first
