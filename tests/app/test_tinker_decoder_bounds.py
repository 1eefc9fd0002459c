"""The forward_backward protobuf decoder does bounded work before any check (hostile probe 2,
finding 5): a packed tensor shape is refused by its length before a varint of it is read, a body of
more fields than a request can need is refused at the bound, a datum's tokens and loss inputs are
counted on views of the body before any becomes a Python list, and the model (with its owner) is
found from the message's top level before the data is decoded at all. The bounds are checked by
what the decoder did (calls counted), not by how long it took."""

from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.runs.models import Run
from app.tinker import proto, work
from app.tinker.models import TinkerFuture, TinkerModel
from tests.app.api import new_tenant
from tests.app.test_tinker_hostile_input import _raw_body
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model

_F32, _I64 = 1, 2


def _tensor(values: np.ndarray, dtype: int, *, shape: bytes | None = None) -> bytes:
    array = np.asarray(values, dtype="<f4" if dtype == _F32 else "<i8")
    packed = proto._varint(len(array)) if shape is None else shape
    return (
        proto._len_field(1, array.tobytes())
        + proto._key(3, 0)
        + proto._varint(dtype)
        + proto._len_field(4, packed)
    )


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of `module.name` (still calling it)."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _post(client: TestClient, body: bytes, headers: dict[str, str]) -> Any:
    return client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)


def _stored(db) -> int:
    db.expire_all()
    kinds = TinkerFuture.kind.in_(("forward", "forward_backward"))
    n = int(db.scalar(select(func.count()).select_from(TinkerFuture).where(kinds)))
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return n


def test_a_huge_packed_shape_is_refused_by_its_length_before_it_is_read(monkeypatch):
    """32 MB of one-byte varints in a shape cost 38 s of CPU, one varint at a time."""
    varints = _counting(monkeypatch, proto, "_read_varint")
    huge = _raw_body("m", 1, np.arange(1, 4), _tensor(np.arange(2, 5), _I64, shape=b"\x01" * (4 << 20)))
    with pytest.raises(proto.ProtoError, match=f"more than {proto.MAX_SHAPE_DIMS} dimensions"):
        proto.decode_forward_backward_request(huge)
    assert len(varints) < 100  # the fields' keys and lengths, none of the shape's 4 Mi varints

    # Nine dimensions as separate (unpacked) fields: refused too, at the ninth.
    unpacked = b"".join(proto._key(4, 0) + proto._varint(1) for _ in range(proto.MAX_SHAPE_DIMS + 1))
    tensor = (
        proto._len_field(1, np.zeros(1, "<i8").tobytes()) + proto._key(3, 0) + proto._varint(_I64) + unpacked
    )
    with pytest.raises(proto.ProtoError, match="dimensions"):
        proto.decode_forward_backward_request(_raw_body("m", 1, np.arange(1, 2), tensor))
    # The SDK's shapes (one dimension, packed) still read.
    fine = proto.decode_forward_backward_request(
        _raw_body("m", 1, np.arange(1, 4), _tensor(np.arange(2, 5), _I64))
    )
    assert fine.data[0].loss_fn_inputs["target_tokens"].shape == [3]


def test_a_body_of_more_fields_than_a_request_needs_is_refused_at_the_bound(monkeypatch):
    monkeypatch.setattr(proto, "MAX_FIELDS", 1000)
    varints = _counting(monkeypatch, proto, "_read_varint")
    # 10,000 top-level forward_only flags: two bytes each, one field each.
    flood = proto._len_field(1, b"m") + (proto._key(6, 0) + proto._varint(1)) * 10_000
    for decode in (proto.decode_forward_backward_request, proto.forward_backward_target):
        varints.clear()
        with pytest.raises(proto.ProtoError, match="more than 1000 protobuf fields"):
            decode(flood)
        assert len(varints) <= 2 * 1000 + 2  # a key and a value per field read, then stopped
    # Strings that are names, not data, are bounded too.
    with pytest.raises(proto.ProtoError, match="model_id is longer than"):
        proto.forward_backward_target(proto._len_field(1, b"m" * (proto.MAX_STRING_BYTES + 1)))


def test_tokens_and_tensors_stay_views_of_the_body_until_checked():
    body = _raw_body("m", 1, np.arange(1, 6), _tensor(np.arange(2, 7), _I64))
    datum = proto.decode_forward_backward_request(body).data[0]
    assert isinstance(datum.token_ids, np.ndarray) and datum.token_ids.base is not None  # a view
    assert datum.loss_fn_inputs["target_tokens"].data.base is not None
    assert datum.tokens == [1, 2, 3, 4, 5]


def test_a_datum_longer_than_the_models_seq_len_is_refused_before_its_tokens_are_converted(
    client, tenant, db, monkeypatch
):
    model_id, headers = _model(client, tenant)  # no pool: the model's seq_len bounds a datum
    seq_len = db.get(Run, db.get(TinkerModel, model_id).run_id).config["seq_len"]
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    converted = _counting(monkeypatch, work, "_token_ids")
    n = 1 << 20  # 4 MiB of int32 tokens in one datum (a single datum passed the request's bound)
    tokens = np.arange(n, dtype="<i4") % 200 + 1
    r = _post(client, _raw_body(model_id, 1, tokens, _tensor(tokens, _I64)), headers)
    assert r.status_code == 422, r.text
    assert f"datum 0: {n} tokens; the model's seq_len is {seq_len}" in r.json()["error"]["message"]
    assert converted == []
    assert _stored(db) == 0


def test_loss_inputs_longer_than_the_datum_are_refused_before_they_are_converted(
    client, tenant, db, monkeypatch
):
    model_id, headers = _model(client, tenant)
    converted = _counting(monkeypatch, work, "_token_ids")
    floats = _counting(monkeypatch, work, "_finite")
    targets = _tensor(np.arange(1 << 20) % 200, _I64)  # a million targets for three tokens
    r = _post(client, _raw_body(model_id, 1, np.arange(1, 4), targets), headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert "target_tokens has 1048576 entries; the model input has 3 tokens" in error["message"]
    assert error["details"][0]["loc"] == ["body", "data", "0", "target_tokens"]
    assert converted == [] and floats == []
    assert _stored(db) == 0


def test_an_unknown_or_another_tenants_model_is_refused_before_the_data_is_decoded(
    client: TestClient, tenant, db, monkeypatch
):
    model_id, headers = _model(client, tenant)
    other = new_tenant(client)
    other_headers = {"X-API-Key": "tml-" + other.key}
    decoded = _counting(monkeypatch, proto, "decode_forward_backward_request")
    body = _fwdbwd_body(model_id, 1, [_datum([1, 2, 3])] * 64)
    for who, target in (
        (other_headers, body),
        (headers, body.replace(model_id.encode(), b"ses_000000000000:train:0")),
    ):
        r = _post(client, target, who)
        assert r.status_code == 404, r.text
        assert "not found" in r.json()["error"]["message"]
    assert decoded == []
    # The owner's request is decoded once; its retry (same seq_id) finds the first future undecoded.
    first = _post(client, body, headers)
    assert first.status_code == 200, first.text
    again = _post(client, body, headers)
    assert again.json()["request_id"] == first.json()["request_id"]
    assert len(decoded) == 1
    assert _stored(db) == 1
