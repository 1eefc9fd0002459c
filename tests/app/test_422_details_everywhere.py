"""Every 422 lists its problems in `details` as `{loc, msg, type}` items (README "Errors"), the Tinker
API's too. A probe found many of its 422s with `"details": null`: a base model's `sample` of
max_tokens 4096 and 64 samples answered "prompt + max_tokens exceeds the pool's max_seq_len 1024" and
no details. Each refusal is driven through HTTP here and the field its details name checked (`loc` of a
body field under "body" on every Tinker route, whether FastAPI validates its body or it parses the
body itself); a 422 raised with no details at all names the body (the safety
net in app/errors.py). Both databases."""

import math
import re
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from app.errors import AppError, NotFound, ValidationFailed
from tests.app.api import TenantHandle, register
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body
from tests.app.tinker_calls import BASE_MODEL, answer_work, new_model, new_session, tinker_headers

TYPE = re.compile(r"[a-z][a-z0-9_]*")


def _details(r: Any, *, code: str = "validation_error") -> list[dict[str, Any]]:
    """The details of a 422 `code`: a non-empty list of `{loc, msg, type}` items."""
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    details = error["details"]
    assert isinstance(details, list) and details, error
    for item in details:
        assert isinstance(item["loc"], list) and item["loc"], item
        assert all(isinstance(part, str) for part in item["loc"]), item
        assert isinstance(item["msg"], str) and item["msg"], item
        assert isinstance(item["type"], str) and TYPE.fullmatch(item["type"]), item
    return list(details)


def _refused_at(r: Any, *locs: list[str], kind: str | None = None) -> list[dict[str, Any]]:
    """A 422 whose details name exactly `locs` (each of type `kind`, when given)."""
    details = _details(r)
    assert [d["loc"] for d in details] == list(locs), details
    if kind is not None:
        assert {d["type"] for d in details} == {kind}, details
    return details


# --------------------------------------------------------------------------- the safety net


class _Unlisted(AppError):
    """A 422 of another class than ValidationFailed, raised without details."""

    status = 422
    code = "validation_error"


@pytest.fixture
def app(app: FastAPI) -> FastAPI:
    """The app with routes that raise 422s without details, as a future raise might."""

    def bare() -> None:
        raise ValidationFailed("a problem nobody named")

    def other_class() -> None:
        raise _Unlisted("another 422 nobody named")

    def not_found() -> None:
        raise NotFound("nothing here")

    app.add_api_route("/test-422/bare", bare)
    app.add_api_route("/test-422/other-class", other_class)
    app.add_api_route("/test-422/not-found", not_found)
    return app


def test_a_422_raised_without_details_names_the_body(client: TestClient) -> None:
    for path, message in (
        ("/test-422/bare", "a problem nobody named"),
        ("/test-422/other-class", "another 422 nobody named"),
    ):
        r = client.get(path)
        assert r.json()["error"]["message"] == message
        assert _details(r) == [{"loc": ["body"], "msg": message, "type": "value_error"}]
    # Other statuses keep what they were raised with.
    r = client.get("/test-422/not-found")
    assert r.status_code == 404 and r.json()["error"]["details"] is None, r.text


def test_details_a_422_is_raised_with_are_kept() -> None:
    listed = [{"loc": ["query", "cursor"], "msg": "not a cursor", "type": "cursor"}]
    assert ValidationFailed("invalid cursor", details=listed).details == listed
    assert ValidationFailed("too many", details={"kind": "datums_per_request"}).details == {
        "kind": "datums_per_request"
    }


# --------------------------------------------------------------------------- sample


def _base_sampler(client: TestClient, headers: dict[str, str]) -> str:
    r = client.post("/api/v1/create_sampling_session", json={"base_model": BASE_MODEL}, headers=headers)
    assert r.status_code == 200, r.text
    sampler_id: str = r.json()["sampling_session_id"]
    return sampler_id


def _sample(client: TestClient, headers: dict[str, str], sampler_id: str, **fields: Any) -> Any:
    body: dict[str, Any] = {
        "sampling_session_id": sampler_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 3},
    }
    return client.post("/api/v1/asample", json=body | fields, headers=headers)


def test_sample_refusals_name_the_field(client: TestClient, tenant: TenantHandle) -> None:
    register(client)  # vocabulary 256, max_seq_len 1024
    headers = tinker_headers(tenant)
    sampler_id = _base_sampler(client, headers)

    # The probe's request.
    r = _sample(client, headers, sampler_id, num_samples=64, sampling_params={"max_tokens": 4096})
    assert "prompt + max_tokens exceeds the pool's max_seq_len 1024" in r.json()["error"]["message"]
    (item,) = _refused_at(r, ["body", "sampling_params", "max_tokens"], kind="too_long")
    assert "4096" in item["msg"] and "1024" in item["msg"]
    # Without max_tokens the default fits what the prompt leaves: a prompt alone too long is at fault.
    long_prompt = {"chunks": [{"tokens": [1] * 1024}]}
    r = _sample(client, headers, sampler_id, prompt=long_prompt, sampling_params={})
    _refused_at(r, ["body", "prompt"], kind="too_long")

    _refused_at(_sample(client, headers, sampler_id, prompt=None), ["body", "prompt"], kind="missing")
    _refused_at(_sample(client, headers, sampler_id, prompt=5), ["body", "prompt"], kind="model_type")
    _refused_at(_sample(client, headers, sampler_id, prompt={}), ["body", "prompt", "chunks"], kind="missing")
    _refused_at(
        _sample(client, headers, sampler_id, prompt={"chunks": {}}),
        ["body", "prompt", "chunks"],
        kind="list_type",
    )
    two_chunks = {"chunks": [{"tokens": [1]}, {"tokens": [2, "3"]}]}
    _refused_at(
        _sample(client, headers, sampler_id, prompt=two_chunks),
        ["body", "prompt", "chunks", "1", "tokens"],
        kind="int_type",
    )
    _refused_at(
        _sample(client, headers, sampler_id, sampling_params=[]),
        ["body", "sampling_params"],
        kind="model_type",
    )
    _refused_at(
        _sample(client, headers, sampler_id, sampling_params={"max_tokens": 3, "stop": 5}),
        ["body", "sampling_params", "stop"],
    )
    _refused_at(
        _sample(client, headers, sampler_id, prompt_logprobs_last_n=1),  # without prompt_logprobs
        ["body", "prompt_logprobs_last_n"],
    )
    r = _sample(
        client,
        headers,
        sampler_id,
        prompt={"chunks": [{"tokens": [1, 300]}]},
        sampling_params={"max_tokens": 3, "stop": [2, 256]},
    )
    _refused_at(r, ["body", "prompt", "chunks"], ["body", "sampling_params", "stop"])
    r = _sample(client, headers, sampler_id, sampling_params={"max_tokens": 3, "stop": [256]})
    _refused_at(r, ["body", "sampling_params", "stop"])


def test_create_sampling_session_refusals_name_the_field(client: TestClient, tenant: TenantHandle) -> None:
    headers = tinker_headers(tenant)
    r = client.post("/api/v1/create_sampling_session", json={"session_id": "ses_x"}, headers=headers)
    _refused_at(r, ["body", "model_path"], ["body", "base_model"], kind="missing")
    for path in ("tinker://m/nowhere/x", "tinker://m/weights/x"):  # malformed; not sampler weights
        r = client.post("/api/v1/create_sampling_session", json={"model_path": path}, headers=headers)
        _refused_at(r, ["body", "model_path"], kind="checkpoint_path")


# --------------------------------------------------------------------------- forward_backward


def _forward_backward(client: TestClient, headers: dict[str, str], body: bytes) -> Any:
    return client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)


def test_forward_backward_refusals_name_the_datum_and_field(client: TestClient, tenant: TenantHandle) -> None:
    register(client)  # vocabulary 256, max_seq_len 1024
    headers = tinker_headers(tenant)
    model_id = new_model(client, tenant)

    def post(data: list[types.Datum], **request: Any) -> Any:
        return _forward_backward(client, headers, _fwdbwd_body(model_id, 1, data, **request))

    _refused_at(_forward_backward(client, headers, b"\x0a\xff"), ["body"], kind="protobuf_invalid")
    _refused_at(post([]), ["body", "data"], kind="too_short")
    no_targets = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={})
    _refused_at(post([_datum([1, 2, 3]), no_targets]), ["body", "data", "1", "target_tokens"], kind="missing")
    r = post([_datum([1, 2, 3], logprobs=[-1.0, -1.0])], loss_fn="ppo")
    _refused_at(r, ["body", "data", "0", "advantages"], kind="missing")
    _refused_at(post([_datum([1] * 1026)]), ["body", "data", "0", "model_input"], kind="too_long")
    _refused_at(
        post([_datum([1, 2, 3]), _datum([1, 300, 3])]),
        ["body", "data", "1", "model_input"],
        ["body", "data", "1", "target_tokens"],
    )
    _refused_at(post([_datum([1, 2, 300])]), ["body", "data", "0", "target_tokens"])


def test_loss_fn_config_refusals_name_the_key(client: TestClient, tenant: TenantHandle) -> None:
    register(client)
    headers = tinker_headers(tenant)
    model_id = new_model(client, tenant)
    datum = _datum([1, 2, 3], logprobs=[-1.0, -1.0], advantages=[1.0, 1.0])

    def post(config: dict[str, float]) -> Any:
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[datum], loss_fn="ppo", loss_fn_config=config
            ),
            model_id=model_id,
            seq_id=1,
        )
        return _forward_backward(
            client, headers, forward_backward_request_to_proto(request).SerializeToString()
        )

    _refused_at(post({f"k{i}": 1.0 for i in range(33)}), ["body", "loss_fn_config"], kind="too_long")
    r = post({"clip_low_threshold": math.nan, "clip_high_threshold": 1.2})
    _refused_at(r, ["body", "loss_fn_config", "clip_low_threshold"], kind="finite_number")


# --------------------------------------------------------------------------- models and checkpoints


def test_create_model_and_checkpoint_path_refusals_name_the_field(
    client: TestClient, tenant: TenantHandle
) -> None:
    headers = tinker_headers(tenant)
    body = {
        "session_id": new_session(client, tenant),
        "model_seq_id": 0,
        "base_model": BASE_MODEL,
        "lora_config": {"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False},
    }
    r = client.post("/api/v1/create_model", json=body, headers=headers)
    _refused_at(r, ["body", "lora_config"])

    bad = "tinker://m/nowhere/x"
    r = client.post("/api/v1/weights_info", json={"tinker_path": bad}, headers=headers)
    _refused_at(r, ["body", "tinker_path"], kind="checkpoint_path")
    r = client.get("/api/v1/loraloom/resolve", params={"path": bad}, headers=headers)
    _refused_at(r, ["query", "path"], kind="checkpoint_path")
    r = client.delete("/api/v1/training_runs/m/checkpoints/nowhere/x", headers=headers)
    _refused_at(r, ["path", "checkpoint_id"], kind="checkpoint_path")
    load = {"path": "tinker://m/sampler_weights/x", "model_id": "m", "seq_id": 1}  # not a training state
    r = client.post("/api/v1/load_weights", json=load, headers=headers)
    _refused_at(r, ["body", "path"], kind="checkpoint_path")


def test_loading_weights_of_another_lora_shape_names_each_field(
    client: TestClient, tenant: TenantHandle
) -> None:
    pool_id = register(client)
    headers = tinker_headers(tenant)
    source = new_model(client, tenant)  # rank 4
    saved = {"model_id": source, "seq_id": 1, "path": "st1"}
    assert client.post("/api/v1/save_weights", json=saved, headers=headers).status_code == 200
    assert [i["kind"] for i in answer_work(client, pool_id)] == ["save_weights"]
    body = {
        "session_id": new_session(client, tenant),
        "model_seq_id": 0,
        "base_model": BASE_MODEL,
        "lora_config": {"rank": 8, "train_unembed": False, "train_mlp": False},
    }
    r = client.post("/api/v1/create_model", json=body, headers=headers)
    assert r.status_code == 200, r.text
    load = {"path": f"tinker://{source}/weights/st1", "model_id": r.json()["model_id"], "seq_id": 1}
    details = _refused_at(
        client.post("/api/v1/load_weights", json=load, headers=headers),
        ["body", "path"],
        kind="lora_mismatch",
    )
    assert details[0]["msg"] == "lora.rank: the saved weights have 4, the model 8", details
