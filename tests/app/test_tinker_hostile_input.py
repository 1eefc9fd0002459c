"""Tinker requests a hostile or careless client can send: every one is a 422 in the uniform body that
names what is wrong, nothing is stored, and nothing reaches a pool that could stop it for every
tenant (a token id outside the vocabulary submitted while no pool is live fails alone on the pool:
tests/e2e/test_tinker_out_of_vocabulary.py)."""

import json
import math
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from app.db import utcnow
from app.runs.models import Run
from app.tinker import proto
from app.tinker import service as tinker_service
from app.tinker.models import TinkerModel, TinkerSession
from tests.app.api import WORKER_HEADERS, TenantHandle, register
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model, _stored

pytestmark = pytest.mark.postgres_only

_F32, _I64 = 1, 2  # the Tinker protobuf's dtype codes


def _tensor(values: list[float], dtype: int) -> bytes:
    array = np.asarray(values, dtype="<f4" if dtype == _F32 else "<i8")
    return (
        proto._len_field(1, array.tobytes())
        + proto._key(3, 0)
        + proto._varint(dtype)
        + proto._len_field(4, proto._varint(len(values)))
    )


def _raw_body(
    model_id: str, seq_id: int, tokens: list[int] | np.ndarray, targets: bytes, extra: bytes = b""
) -> bytes:
    """A ForwardBackwardRequest written field by field (what the SDK cannot be made to send)."""
    chunk = proto._len_field(1, proto._len_field(1, np.asarray(tokens, "<i4").tobytes()))
    datum = proto._len_field(1, chunk) + proto._len_field(
        2, proto._len_field(1, b"target_tokens") + proto._len_field(2, targets)
    )
    return (
        proto._len_field(1, model_id.encode())
        + proto._key(2, 0)
        + proto._varint(seq_id)
        + proto._len_field(3, datum)
        + proto._len_field(4, b"cross_entropy")
        + extra
    )


def _post(client: TestClient, body: bytes, headers: dict[str, str]) -> Any:
    return client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)


def _assert_refused(r: Any, *words: str) -> None:
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_token_ids_are_whole_non_negative_int32_with_or_without_a_pool(client, tenant, db):
    model_id, headers = _model(client, tenant)  # no pool is registered: no vocabulary known
    cases = {
        "NaN target": _raw_body(model_id, 1, [1, 2], _tensor([1.0, math.nan], _F32)),
        "infinite target": _raw_body(model_id, 1, [1, 2], _tensor([1.0, math.inf], _F32)),
        "fractional target": _raw_body(model_id, 1, [1, 2], _tensor([1.7, 2.2], _F32)),
        "negative target": _raw_body(model_id, 1, [1, 2], _tensor([-5, 2], _I64)),
        "target beyond int32": _raw_body(model_id, 1, [1, 2], _tensor([2**40, 2], _I64)),
        "negative token": _raw_body(model_id, 1, [1, -3], _tensor([2, 3], _I64)),
    }
    for label, body in cases.items():
        r = _post(client, body, headers)
        _assert_refused(r, "datum 0", "token ids")
        assert r.json()["error"]["details"][0]["loc"][:3] == ["body", "data", "0"], label
    # A float tensor of whole numbers is a tensor of ids (the SDK may send either dtype).
    ok = _post(client, _raw_body(model_id, 1, [1, 2], _tensor([2.0, 3.0], _F32)), headers)
    assert ok.status_code == 200, ok.text
    assert _stored(db) == 1


def test_without_a_pool_the_models_seq_len_bounds_a_datum(client, tenant, db):
    model_id, headers = _model(client, tenant)
    run_seq_len = db.get(Run, db.get(TinkerModel, model_id).run_id).config["seq_len"]
    too_long = list(range(1, run_seq_len + 3))  # run_seq_len + 1 model-input tokens
    r = _post(client, _fwdbwd_body(model_id, 1, [_datum(too_long)]), headers)
    _assert_refused(r, "datum 0", f"seq_len is {run_seq_len}")
    assert _stored(db) == 0


def test_non_finite_loss_inputs_and_config_are_refused_by_name(client, tenant, db):
    register(client)
    model_id, headers = _model(client, tenant)
    nan_weight = _fwdbwd_body(model_id, 1, [_datum([1, 2, 3], weights=[math.nan, 1.0])])
    _assert_refused(_post(client, nan_weight, headers), "datum 0", "weights", "finite")
    inf_advantage = _fwdbwd_body(
        model_id,
        1,
        [_datum([1, 2, 3], advantages=[math.inf, 1.0], logprobs=[0.0, 0.0])],
        loss_fn="importance_sampling",
    )
    _assert_refused(_post(client, inf_advantage, headers), "datum 0", "advantages", "finite")
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum([1, 2, 3])], loss_fn="cross_entropy", loss_fn_config={"x": math.nan}
        ),
        model_id=model_id,
        seq_id=1,
    )
    nan_config = forward_backward_request_to_proto(request).SerializeToString()
    _assert_refused(_post(client, nan_config, headers), "loss_fn_config", "finite")
    # A varint of ten bytes with bits above 63 (a legacy loss_fn_config double): no 64-bit value.
    entry = proto._len_field(1, b"x") + proto._key(2, 0) + bytes([0xFF] * 9 + [0x7F])
    overlong = _raw_body(model_id, 1, [1, 2], _tensor([2, 3], _I64), extra=proto._len_field(5, entry))
    _assert_refused(_post(client, overlong, headers), "malformed", "64 bits")
    assert _stored(db) == 0


def _saved_weights(client: TestClient, tenant: TenantHandle, pool_id: str) -> tuple[str, str, dict[str, str]]:
    model_id, headers = _model(client, tenant)
    r = client.post(
        "/api/v1/save_weights", json={"model_id": model_id, "seq_id": 1, "path": "s1"}, headers=headers
    )
    assert r.status_code == 200, r.text
    items = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    results = [{"request_id": item["request_id"]} for item in items]
    client.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
    )
    return model_id, f"tinker://{model_id}/weights/s1", headers


def test_counters_and_metadata_are_checked_and_listings_survive(client, tenant, db):
    pool_id = register(client)
    model_id, path, headers = _saved_weights(client, tenant, pool_id)
    session_id = model_id.split(":")[0]
    for seq_id in (True, -1, 2**40, "3"):
        r = client.post(
            "/api/v1/optim_step",
            json={"model_id": model_id, "seq_id": seq_id, "adam_params": {}},
            headers=headers,
        )
        _assert_refused(r, "seq_id")
    for model_seq_id in (True, -3, 2**40):
        body = {"path": path, "session_id": session_id, "model_seq_id": model_seq_id}
        _assert_refused(client.post("/api/v1/load_weights", json=body, headers=headers), "model_seq_id")
    body = {"path": path, "session_id": session_id, "model_seq_id": 7, "user_metadata": [1, 2, 3]}
    _assert_refused(client.post("/api/v1/load_weights", json=body, headers=headers), "user_metadata")
    huge = {"path": path, "session_id": session_id, "model_seq_id": 7, "user_metadata": {"a": "x" * 20_000}}
    _assert_refused(client.post("/api/v1/load_weights", json=huge, headers=headers), "user_metadata")
    assert db.get(TinkerModel, f"{session_id}:train:7") is None
    create = {
        "session_id": session_id,
        "model_seq_id": 8,
        "base_model": "loraloom-tiny",
        "lora_config": {"rank": 4},
        "user_metadata": {"notes": "y" * 20_000},
    }
    assert client.post("/api/v1/create_model", json=create, headers=headers).status_code == 422
    tags = {"tags": ["t" * 10_000], "sdk_version": "test"}
    assert client.post("/api/v1/create_session", json=tags, headers=headers).status_code == 422

    # A model loaded from saved weights is not created again by create_model (was a 500).
    loaded = {"path": path, "session_id": session_id, "model_seq_id": 5}
    assert client.post("/api/v1/load_weights", json=loaded, headers=headers).status_code == 200
    again = {
        "session_id": session_id,
        "model_seq_id": 5,
        "base_model": "loraloom-tiny",
        "lora_config": {"rank": 4},
    }
    _assert_refused(client.post("/api/v1/create_model", json=again, headers=headers), "exists already")

    # A row stored before user_metadata was checked does not break the tenant's listings.
    db.get(TinkerModel, f"{session_id}:train:5").user_metadata = [1, 2, 3]
    db.commit()
    assert client.get("/api/v1/training_runs", headers=headers).status_code == 200
    assert client.get(f"/api/v1/training_runs/{session_id}:train:5", headers=headers).status_code == 200


def test_user_metadata_a_listing_could_not_send_back_is_refused(client, tenant, db):
    """Its values are Any: a lone surrogate (JSON's "\\ud800" parses to one) was stored and made every
    GET /api/v1/training_runs of the tenant a 500; NaN was stored on SQLite."""
    pool_id = register(client)
    model_id, path, headers = _saved_weights(client, tenant, pool_id)
    session_id = model_id.split(":")[0]
    sessions = db.scalar(select(func.count()).select_from(TinkerSession))

    def post(route: str, body: dict[str, Any]) -> Any:
        # json.dumps escapes a lone surrogate as `\ud800` (the client's own encoder cannot send one)
        content = json.dumps(body)
        return client.post(route, content=content, headers=headers | {"Content-Type": "application/json"})

    create = {
        "session_id": session_id,
        "model_seq_id": 8,
        "base_model": "loraloom-tiny",
        "lora_config": {"rank": 4, "train_unembed": False, "train_mlp": False},
    }
    load = {"path": path, "session_id": session_id, "model_seq_id": 7}
    for metadata in ({"k": "\ud800"}, {"\udfff": "v"}, {"k": ["ok", {"deep": "\ud800"}]}, {"k": math.nan}):
        for route, body in (
            ("/api/v1/create_model", create),
            ("/api/v1/load_weights", load),
            ("/api/v1/create_session", {"tags": [], "sdk_version": "test"}),
        ):
            r = post(route, body | {"user_metadata": metadata})
            assert r.status_code == 422, (route, r.text)
            error = r.json()["error"]
            assert error["code"] == "validation_error", (route, error)
            assert any("user_metadata" in d["loc"] for d in error["details"]), (route, error)
    db.expire_all()
    assert db.get(TinkerModel, f"{session_id}:train:8") is None
    assert db.get(TinkerModel, f"{session_id}:train:7") is None
    assert db.scalar(select(func.count()).select_from(TinkerSession)) == sessions
    assert client.get("/api/v1/training_runs", headers=headers).status_code == 200
    # Text outside the BMP (a surrogate pair in JSON) is Unicode like any other.
    fine = post("/api/v1/create_model", create | {"user_metadata": {"k": "\U0001f600"}})
    assert fine.status_code == 200, fine.text
    listed = client.get("/api/v1/training_runs", headers=headers)
    assert {"k": "\U0001f600"} in [run["user_metadata"] for run in listed.json()["training_runs"]]


def test_deleting_sampler_weights_retires_the_samplers_made_from_them(client, tenant):
    pool_id = register(client)
    model_id, headers = _model(client, tenant)
    saved = client.post(
        "/api/v1/save_weights_for_sampler",
        json={"model_id": model_id, "seq_id": 1, "path": "w"},
        headers=headers,
    )
    assert saved.status_code == 200, saved.text
    items = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    results = [{"request_id": i["request_id"], "metrics": {"step": 1}} for i in items]
    client.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
    )
    path = f"tinker://{model_id}/sampler_weights/w"
    sampler = client.post("/api/v1/create_sampling_session", json={"model_path": path}, headers=headers)
    sampler_id = sampler.json()["sampling_session_id"]
    assert client.get(f"/api/v1/samplers/{sampler_id}", headers=headers).status_code == 200
    deleted = client.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/w", headers=headers
    )
    assert deleted.status_code == 204, deleted.text
    gone = client.get(f"/api/v1/samplers/{sampler_id}", headers=headers)
    assert gone.status_code == 404 and "were deleted" in gone.json()["error"]["message"]
    body = {
        "sampling_session_id": sampler_id,
        "prompt": {"chunks": [{"tokens": [1, 2]}]},
        "sampling_params": {},
    }
    assert client.post("/api/v1/asample", json=body, headers=headers).status_code == 404
    # The name saved again holds other weights (a later step): the old sampler stays retired.
    again = {"model_id": model_id, "seq_id": 2, "path": "w"}
    assert client.post("/api/v1/save_weights_for_sampler", json=again, headers=headers).status_code == 200
    items = client.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    results = [{"request_id": i["request_id"], "metrics": {"step": 2}} for i in items]
    client.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
    )
    assert client.get(f"/api/v1/samplers/{sampler_id}", headers=headers).status_code == 404


def test_live_sessions_per_tenant_are_bounded_and_freed_by_finish_or_silence(
    client, tenant, other_tenant, db, settings, monkeypatch
):
    monkeypatch.setattr(settings, "tinker_max_live_sessions_per_tenant", 3)
    headers = {"X-API-Key": "tml-" + tenant.key}

    def create(h: dict[str, str]) -> Any:
        return client.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"}, headers=h)

    ids = [create(headers).json()["session_id"] for _ in range(3)]
    refused = create(headers)
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == "10"
    assert refused.json()["error"]["details"] == {"kind": "live_sessions", "live": 3, "limit": 3}
    db.expire_all()
    assert (
        db.scalar(select(func.count()).select_from(TinkerSession).where(TinkerSession.tenant_id == tenant.id))
        == 3
    )
    # Another tenant is not held back by this one's sessions.
    assert create({"X-API-Key": "tml-" + other_tenant.key}).status_code == 200

    # A finished session frees its place ...
    assert client.post(f"/api/v1/sessions/{ids[0]}/finish", headers=headers).status_code == 204
    assert create(headers).status_code == 200
    assert create(headers).status_code == 429
    # ... and so does one whose SDK has gone silent (no heartbeat for SESSION_SILENT_SECONDS).
    silent = db.get(TinkerSession, ids[1])
    silent.last_heartbeat_at = utcnow() - timedelta(seconds=tinker_service.SESSION_SILENT_SECONDS + 1)
    db.commit()
    assert create(headers).status_code == 200
