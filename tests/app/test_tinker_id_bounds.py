"""Ids the Tinker routes take are bounded where they enter, and no message repeats more than a
bounded start of one (hostile probe h1, findings 7 and 8).

- A 5000-character model_id (or session, sampler id, path; in a body or the URL) came back whole in
  its 404: now a 422 naming the field, as /v1 does with its 64-character path ids.
- `smpbase_AAAA`, a base sampler id that decodes to NULs, went to Postgres as a base model's name
  (a vague 422 "a value is out of the range the service stores"): now the 404 any unknown sampling
  session gets. A NUL in any id is a 422 naming the field.

Real HTTP (uvicorn), both databases.
"""

from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from app.tinker.sampling import base_sampler_id
from app.tinker.schemas import MAX_ID_CHARS, MAX_SAMPLER_ID_CHARS, SHOWN_CHARS
from tests.app.api import new_tenant, register
from tests.app.tinker_calls import BASE_MODEL, new_model, new_session, stored, tinker_headers

LONG = "A" * 5000
TARGETS: dict[str, Any] = {"target_tokens": [2, 3]}  # the SDK converts a plain list to TensorData


def _refused_naming(r: Any, loc: list[str]) -> None:
    """A 422 naming `loc` that repeats no long run of the id (the body's or FastAPI's own)."""
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    assert loc in [d["loc"] for d in error["details"]], error
    assert "A" * (SHOWN_CHARS + 1) not in r.text


def _not_found(r: Any, message: str) -> None:
    assert r.status_code == 404, r.text
    assert r.json()["error"]["message"] == message


def _sample(sampler_id: str) -> dict[str, Any]:
    return {
        "sampling_session_id": sampler_id,
        "prompt": {"chunks": [{"tokens": [1, 2]}]},
        "sampling_params": {},
    }


def test_long_ids_in_bodies_are_422s_naming_the_field(http: httpx.Client, db: Session) -> None:
    tenant = new_tenant(http)
    headers = tinker_headers(tenant)
    register(http)
    model_id = new_model(http, tenant)
    before = stored(db)
    long_path = f"tinker://{LONG}/weights/x"
    cases: list[tuple[str, dict[str, Any], list[str]]] = [
        ("optim_step", {"model_id": LONG, "seq_id": 1, "adam_params": {}}, ["body", "model_id"]),
        ("save_weights", {"model_id": LONG, "seq_id": 1}, ["body", "model_id"]),
        ("save_weights_for_sampler", {"model_id": LONG, "seq_id": 1}, ["body", "model_id"]),
        ("load_weights", {"path": long_path, "model_id": model_id, "seq_id": 1}, ["body", "path"]),
        (
            "load_weights",
            {"path": f"tinker://{model_id}/weights/x", "model_id": LONG, "seq_id": 1},
            ["body", "model_id"],
        ),
        (
            "load_weights",
            {"path": f"tinker://{model_id}/weights/x", "session_id": LONG},
            ["body", "session_id"],
        ),
        ("create_sampling_session", {"model_path": long_path}, ["body", "model_path"]),
        ("create_sampling_session", {"base_model": LONG}, ["body", "base_model"]),
        ("asample", _sample(LONG), ["body", "sampling_session_id"]),
        # Not a NUL (the request guard refuses those in any body): a control character, a space.
        ("create_sampling_session", {"base_model": "tiny\u0001"}, ["body", "base_model"]),
        ("asample", _sample("smp_\u007f"), ["body", "sampling_session_id"]),
        ("optim_step", {"model_id": "ses_x :train:0", "seq_id": 1, "adam_params": {}}, ["body", "model_id"]),
        ("session_heartbeat", {"session_id": LONG}, ["body", "session_id"]),
        ("get_info", {"model_id": LONG}, ["body", "model_id"]),
        ("retrieve_future", {"request_id": LONG}, ["body", "request_id"]),
        ("weights_info", {"tinker_path": long_path}, ["body", "tinker_path"]),
        (
            "create_model",
            {"session_id": LONG, "model_seq_id": 1, "base_model": BASE_MODEL},
            ["body", "session_id"],
        ),
    ]
    for route, body, loc in cases:
        _refused_naming(http.post(f"/api/v1/{route}", json=body, headers=headers), loc)
    # The protobuf body's model_id is bounded as the JSON ones are.
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs=TARGETS)],
            loss_fn="cross_entropy",
        ),
        model_id="A" * 1000,
        seq_id=1,
    )
    r = http.post(
        "/api/v1/forward_backward",
        content=forward_backward_request_to_proto(request).SerializeToString(),
        headers=headers | {"Content-Type": "application/x-protobuf"},
    )
    _refused_naming(r, ["body", "model_id"])
    assert stored(db) == before


def test_long_ids_in_paths_are_422s_naming_the_parameter(http: httpx.Client) -> None:
    tenant = new_tenant(http)
    headers = tinker_headers(tenant)
    model_id = new_model(http, tenant)
    for method, url, loc in (
        ("GET", f"/api/v1/training_runs/{LONG}", ["path", "training_run_id"]),
        ("GET", f"/api/v1/training_runs/{LONG}/checkpoints", ["path", "training_run_id"]),
        ("DELETE", f"/api/v1/training_runs/{LONG}/checkpoints/weights/x", ["path", "training_run_id"]),
        ("DELETE", f"/api/v1/training_runs/{model_id}/checkpoints/weights/{LONG}", ["path", "checkpoint_id"]),
        ("POST", f"/api/v1/sessions/{LONG}/finish", ["path", "session_id"]),
        ("GET", f"/api/v1/samplers/smpbase_{LONG}", ["path", "sampler_id"]),
        ("GET", "/api/v1/samplers/smp_%01", ["path", "sampler_id"]),
        ("GET", f"/api/v1/loraloom/resolve?path=tinker://{LONG}/sampler_weights/x", ["query", "path"]),
    ):
        _refused_naming(http.request(method, url, headers=headers), loc)


def test_ids_within_the_bounds_are_404s_that_repeat_a_bounded_start(http: httpx.Client) -> None:
    tenant = new_tenant(http)
    headers = tinker_headers(tenant)
    longest = "m" * MAX_ID_CHARS
    _not_found(http.get(f"/api/v1/training_runs/{longest}", headers=headers), f"model {longest} not found")
    body = {"model_id": longest, "seq_id": 1, "adam_params": {}}
    _not_found(http.post("/api/v1/optim_step", json=body, headers=headers), f"model {longest} not found")
    _not_found(
        http.post(f"/api/v1/sessions/{longest}/finish", headers=headers), f"session {longest} not found"
    )
    # A base sampler id of the longest a base model name gives, naming no base model: its start only.
    sampler_id = "smp_" + "B" * (MAX_SAMPLER_ID_CHARS - 4)
    message = f"sampling session {sampler_id[:SHOWN_CHARS]}... ({MAX_SAMPLER_ID_CHARS} characters) not found"
    _not_found(http.get(f"/api/v1/samplers/{sampler_id}", headers=headers), message)
    _not_found(http.post("/api/v1/asample", json=_sample(sampler_id), headers=headers), message)


@pytest.mark.parametrize(
    "sampler_id",
    [
        "smpbase_AAAA",  # "\x00\x00\x00"
        "smpbase_" + "A" * 1000,  # 750 NULs
        base_sampler_id("lora\x01loom"),  # a control character
        base_sampler_id("x" * 257),  # longer than a base model's name may be
        base_sampler_id(BASE_MODEL).replace("smpbase_", "smpbase_!"),  # not the one spelling
        base_sampler_id(BASE_MODEL) + "B",  # spare bits set: decodes to the same name
        "smpbase_@@@@",  # not base64url (skipped by the decoder: an empty name)
        "smpbase_++++",  # base64, not base64url: not UTF-8 once decoded
    ],
)
def test_a_base_sampler_id_that_names_no_base_model_is_a_404(
    http: httpx.Client, db: Session, sampler_id: str
) -> None:
    tenant = new_tenant(http)
    headers = tinker_headers(tenant)
    register(http)  # a live pool of BASE_MODEL: its own base sampler id works
    own = base_sampler_id(BASE_MODEL)
    assert http.get(f"/api/v1/samplers/{own}", headers=headers).json() == {
        "sampler_id": own,
        "base_model": BASE_MODEL,
    }
    before = stored(db)
    message = f"sampling session {sampler_id[:SHOWN_CHARS]}" + (
        f"... ({len(sampler_id)} characters)" if len(sampler_id) > SHOWN_CHARS else ""
    )
    _not_found(http.get(f"/api/v1/samplers/{sampler_id}", headers=headers), f"{message} not found")
    _not_found(
        http.post("/api/v1/asample", json=_sample(sampler_id), headers=headers), f"{message} not found"
    )
    assert stored(db) == before


def test_the_longest_ids_and_paths_the_service_makes_fit_the_bounds(http: httpx.Client) -> None:
    """The longest model id the service makes (model_seq_id at its bound) works end to end."""
    tenant = new_tenant(http)
    headers = tinker_headers(tenant)
    session_id = new_session(http, tenant)
    model_id = new_model(http, tenant, session_id=session_id, seq=1_000_000)
    assert len(model_id) <= 30
    name = "n" * 128
    r = http.post(
        "/api/v1/save_weights_for_sampler",
        json={"model_id": model_id, "seq_id": 1, "path": name},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    assert http.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=headers).status_code == 200
    path = f"tinker://{model_id}/sampler_weights/{name}"
    _not_found(  # not saved yet (no pool): a 404, not a 422, for the longest path the service names
        http.get("/api/v1/loraloom/resolve", params={"path": path}, headers=headers),
        f"checkpoint {path} not found",
    )
