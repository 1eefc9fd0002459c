"""Tinker bodies are typed as the Tinker API types them (hostile probe h1, finding 5): pydantic's lax
mode took `true` for a learning rate (the step ran at 1.0), `"1e-3"` for a number, `true`, `"3"` or
`1.0` for a count and `"yes"` for a flag, `"path": 0` saved under the default name, and a ppo
`loss_fn_config` of any keys and an empty clip interval. Each is now a 422 whose message names the
field, and nothing is stored; what the SDK sends (an int where a float is typed included: JSON has
one number type) is taken as before. Real HTTP (uvicorn), both databases."""

import math
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from app.tinker.schemas import SHOWN_CHARS
from tests.app.api import TenantHandle, new_tenant, register
from tests.app.tinker_calls import BASE_MODEL, answer_work, new_model, new_session, stored, tinker_headers

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _refused(r: Any, *fields: str) -> dict[str, Any]:
    """A 422 in the uniform body whose message and details name every one of `fields`."""
    assert r.status_code == 422, r.text
    error: dict[str, Any] = r.json()["error"]
    assert error["code"] == "validation_error", error
    for field in fields:
        assert field in error["message"], (field, error)
        assert any(d["loc"] == ["body", *field.split(".")] for d in error["details"]), (field, error)
    return error


@dataclass(frozen=True)
class Setup:
    tenant: TenantHandle
    headers: dict[str, str]
    """The tenant's Tinker headers."""
    model_id: str
    pool_id: str
    """A live pool of the model's base model."""


@pytest.fixture
def setup(http: httpx.Client) -> Setup:
    tenant = new_tenant(http, quota=3)
    pool_id = register(http)
    return Setup(tenant, tinker_headers(tenant), new_model(http, tenant), pool_id)


def test_adam_params_take_json_numbers_only(http: httpx.Client, db: Session, setup: Setup) -> None:
    headers, model_id, pool_id = setup.headers, setup.model_id, setup.pool_id
    before = stored(db)
    for name, value in (("learning_rate", True), ("learning_rate", "1e-3"), ("beta1", "0.9"), ("eps", None)):
        body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3, name: value}}
        _refused(http.post("/api/v1/optim_step", json=body, headers=headers), f"adam_params.{name}")
    assert stored(db) == before
    # An int is a number: the learning rate 1 is taken (at the bound), as 1.0 would be.
    body = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1, "grad_clip_norm": 0}}
    assert http.post("/api/v1/optim_step", json=body, headers=headers).status_code == 200
    (item,) = answer_work(http, pool_id)
    assert item["adam"]["learning_rate"] == 1.0 and item["adam"]["beta2"] == 0.95


def test_ids_counters_names_and_flags_take_their_type_only(
    http: httpx.Client, db: Session, setup: Setup
) -> None:
    headers, model_id = setup.headers, setup.model_id
    before = stored(db)
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("optim_step", {"model_id": 5, "seq_id": 1, "adam_params": {}}, "model_id"),
        ("optim_step", {"model_id": model_id, "seq_id": 1.0, "adam_params": {}}, "seq_id"),
        ("optim_step", {"model_id": model_id, "adam_params": {}}, "seq_id"),
        ("save_weights", {"model_id": model_id, "seq_id": 1, "path": 0}, "path"),
        ("save_weights", {"model_id": model_id, "seq_id": 1, "path": True}, "path"),
        ("save_weights", {"model_id": model_id, "seq_id": 1, "path": ""}, "path"),  # not "no name"
        ("save_weights", {"model_id": [model_id], "seq_id": 1}, "model_id"),
        ("save_weights_for_sampler", {"model_id": model_id, "seq_id": 1, "path": 0}, "path"),
        ("save_weights_for_sampler", {"model_id": model_id, "seq_id": 1, "kind": 1}, "kind"),
        ("load_weights", {"path": 0, "model_id": model_id, "seq_id": 1}, "path"),
        ("load_weights", {"path": f"tinker://{model_id}/weights/x", "model_id": 7, "seq_id": 1}, "model_id"),
        (
            "load_weights",
            {"path": f"tinker://{model_id}/weights/x", "model_id": model_id, "seq_id": 1, "optimizer": "no"},
            "optimizer",
        ),
        ("load_weights", {"path": f"tinker://{model_id}/weights/x", "session_id": 3}, "session_id"),
        ("load_weights", {"path": f"tinker://{model_id}/weights/x", "model_seq_id": "1"}, "model_seq_id"),
        ("create_sampling_session", {"model_path": 0}, "model_path"),
        ("create_sampling_session", {"base_model": 5}, "base_model"),
        ("create_model", {"session_id": "s", "model_seq_id": "1", "base_model": BASE_MODEL}, "model_seq_id"),
        (
            "create_model",
            {"session_id": "s", "model_seq_id": 1, "base_model": BASE_MODEL, "lora_config": {"rank": "4"}},
            "lora_config.rank",
        ),
        (
            "create_model",
            {
                "session_id": "s",
                "model_seq_id": 1,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 4, "train_mlp": "yes"},
            },
            "lora_config.train_mlp",
        ),
        ("get_info", {"model_id": 12}, "model_id"),
        ("retrieve_future", {"request_id": 12}, "request_id"),
    ]
    for route, body, field in cases:
        r = http.post(f"/api/v1/{route}", json=body, headers=headers)
        assert r.status_code == 422, (route, body, r.text)
        error = r.json()["error"]
        # Under "body" on every route, whether FastAPI validates its body or the route parses it.
        assert any(d["loc"] == ["body", *field.split(".")] for d in error["details"]), (route, body, error)
        if route not in ("create_model", "get_info", "retrieve_future"):  # FastAPI's own 422s
            assert field in error["message"], (route, body, error)
    # A NaN is not a name (it was saved as "nan").
    nan_path = b'{"model_id": "%s", "seq_id": 1, "path": NaN}' % model_id.encode()
    r = http.post(
        "/api/v1/save_weights", content=nan_path, headers=headers | {"Content-Type": "application/json"}
    )
    _refused(r, "path")
    assert stored(db) == before


def test_a_save_without_a_name_takes_the_default_and_a_name_is_kept(http: httpx.Client, setup: Setup) -> None:
    headers, model_id, pool_id = setup.headers, setup.model_id, setup.pool_id
    for seq_id, body in ((1, {}), (2, {"path": None}), (3, {"path": "mine"})):
        r = http.post(
            "/api/v1/save_weights", json={"model_id": model_id, "seq_id": seq_id, **body}, headers=headers
        )
        assert r.status_code == 200, r.text
    assert [i["name"] for i in answer_work(http, pool_id)] == ["state", "state", "mine"]


def test_sample_counts_flags_and_parameters_take_their_type_only(
    http: httpx.Client, db: Session, setup: Setup
) -> None:
    headers = setup.headers
    session_id = new_session(http, setup.tenant)
    opened = http.post(
        "/api/v1/create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE_MODEL},
        headers=headers,
    )
    sampler_id = opened.json()["sampling_session_id"]
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 2},
    }
    before = stored(db)
    params = body["sampling_params"]
    for change, field in (
        ({"num_samples": True}, "num_samples"),
        ({"num_samples": "3"}, "num_samples"),
        ({"num_samples": 1.0}, "num_samples"),
        ({"prompt_logprobs": "yes"}, "prompt_logprobs"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": "1"}, "prompt_logprobs_last_n"),
        ({"sampling_session_id": 5}, "sampling_session_id"),
        ({"sampling_params": params | {"temperature": "0.5"}}, "sampling_params.temperature"),
        ({"sampling_params": params | {"top_p": True}}, "sampling_params.top_p"),
        ({"sampling_params": params | {"top_k": 2.0}}, "sampling_params.top_k"),
        ({"sampling_params": params | {"max_tokens": 2.0}}, "sampling_params.max_tokens"),
        ({"sampling_params": params | {"seed": "4"}}, "sampling_params.seed"),
    ):
        _refused(http.post("/api/v1/asample", json=body | change, headers=headers), field)
    assert stored(db) == before
    # What the SDK sends: ints for its float defaults (temperature 1, top_p 1), a bool flag.
    fine = body | {
        "prompt_logprobs": True,
        "sampling_params": params | {"temperature": 1, "top_p": 1, "top_k": -1},
    }
    assert http.post("/api/v1/asample", json=fine, headers=headers).status_code == 200


def _fwdbwd(
    model_id: str, loss_fn: types.LossFnType, config: dict[str, float] | None, seq_id: int = 1
) -> bytes:
    # The SDK converts plain lists to TensorData.
    inputs: dict[str, Any] = {"target_tokens": [2, 3, 4], "logprobs": [-1.0] * 3, "advantages": [1.0] * 3}
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_loss_fn_config_takes_the_keys_the_loss_reads_and_clip_bounds_around_one(
    http: httpx.Client, db: Session, setup: Setup
) -> None:
    headers, model_id, pool_id = setup.headers, setup.model_id, setup.pool_id
    before = stored(db)

    def post(loss_fn: types.LossFnType, config: dict[str, float]) -> Any:
        return http.post(
            "/api/v1/forward_backward", content=_fwdbwd(model_id, loss_fn, config), headers=headers | PROTOBUF
        )

    # The probe's empty interval: both bounds named, and the valid ranges said.
    error = _refused(
        post("ppo", {"clip_low_threshold": 5.0, "clip_high_threshold": -3.0}),
        "loss_fn_config.clip_low_threshold",
        "loss_fn_config.clip_high_threshold",
    )
    assert "0 <= clip_low_threshold <= 1 <= clip_high_threshold" in error["message"]
    _refused(post("cispo", {"clip_high_threshold": 0.9}), "loss_fn_config.clip_high_threshold")
    _refused(post("ppo", {"clip_low_threshold": -0.1}), "loss_fn_config.clip_low_threshold")
    # A key the loss does not read is named, not ignored (a misspelt bound trained with the default).
    error = _refused(post("ppo", {"clip_low_threshold": 0.9, "bogus": 1.0}), "loss_fn_config.bogus")
    assert "clip_low_threshold, clip_high_threshold" in error["message"]
    _refused(post("cross_entropy", {"clip_low_threshold": 0.9}), "loss_fn_config.clip_low_threshold")
    _refused(post("importance_sampling", {"beta": 0.1}), "loss_fn_config.beta")
    # A key is repeated up to a bound (the SDK's encoder takes keys of any length; ours up to 1 KiB).
    error = _refused(post("ppo", {"k" * 1000: 1.0}))
    assert "k" * (SHOWN_CHARS + 1) not in repr(error) and "k" * SHOWN_CHARS in error["message"], error
    assert stored(db) == before

    taken: tuple[tuple[types.LossFnType, dict[str, float]], ...] = (
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 5.0}),
        ("ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}),
        ("ppo", {}),
    )
    for seq_id, (loss_fn, config) in enumerate(taken, start=1):
        body = _fwdbwd(model_id, loss_fn, config, seq_id)
        r = http.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)
        assert r.status_code == 200, (loss_fn, config, r.text)
    assert [i["loss_fn_config"] for i in answer_work(http, pool_id)] == [
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        {"clip_low_threshold": 0.0, "clip_high_threshold": 5.0},
        {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0},
        {},
    ]


def test_non_finite_clip_bounds_are_still_refused_as_not_finite(http: httpx.Client, setup: Setup) -> None:
    headers, model_id = setup.headers, setup.model_id
    body = _fwdbwd(model_id, "ppo", {"clip_low_threshold": math.nan})
    r = http.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)
    assert r.status_code == 422 and "finite" in r.json()["error"]["message"], r.text
