"""The binary form of rollout batches (contracts/arrays.py) through the service: the same batch sent
as JSON lists and as binary arrays is one request (same stored bytes, same digest), and every
bad-input case of the batch table, sent in binary form, gets the 4xx its list form gets."""

import copy
import hashlib
import math
from typing import Any

import msgspec
import numpy as np
import pytest
from sqlalchemy import select

from app.batches.models import Batch
from contracts.arrays import FLOAT_DTYPE, IDS_DTYPE, MASK_DTYPE, encode, to_arrays
from contracts.wire import batch_json_decoder
from tests.app.api import MSGPACK, batch_body, post_batch
from tests.app.factories import Seeded, batch_count, committed, rollout_files, seed_run
from tests.app.test_batches import BAD_INPUTS, Bad, validating_run  # noqa: F401 (a fixture)

_DTYPES: dict[str, np.dtype] = {
    "prompt_ids": IDS_DTYPE,
    "completion_ids": IDS_DTYPE,
    "prompt_mask": MASK_DTYPE,
    "completion_mask": MASK_DTYPE,
    "completion_logprobs": FLOAT_DTYPE,
    "advantage": FLOAT_DTYPE,
    "teacher_logprobs": FLOAT_DTYPE,
    "token_rewards": FLOAT_DTYPE,
    "weights": FLOAT_DTYPE,
}


def _as_bytes(values: Any, dtype: np.dtype) -> Any:
    """A per-token list as the binary form's bytes; anything that is not a list of numbers (a
    wrong type the table sends on purpose) is left as it is."""
    if not isinstance(values, list) or not all(isinstance(v, int | float) for v in values):
        return values
    if dtype == MASK_DTYPE and not all(isinstance(v, bool) for v in values):
        return values  # ints in a mask: a wrong type in both forms
    return np.asarray(values, dtype=dtype).tobytes()


def binary_body(body: dict[str, Any]) -> dict[str, Any]:
    """A (possibly broken) list body in the binary form, field by field, faults kept."""
    out = copy.deepcopy(body)
    for sample in out.get("examples", []):
        for name, dtype in _DTYPES.items():
            if name in sample:
                sample[name] = _as_bytes(sample[name], dtype)
    return out


def post_binary(client: Any, seeded: Seeded, body: dict[str, Any], *, key: str | None = None) -> Any:
    headers = dict(seeded.headers) | {"Content-Type": MSGPACK}
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(
        f"/v1/runs/{seeded.run_id}/batches", content=msgspec.msgpack.encode(body), headers=headers
    )


def _stored(settings: Any, batch_id: int) -> tuple[bytes, str, str]:
    with committed(settings) as session:
        row = session.get(Batch, batch_id)
        assert row is not None
        return (settings.data_dir / row.payload_path).read_bytes(), row.request_hash, row.payload_sha256


def test_json_and_binary_bodies_store_the_same_bytes_and_hash(settings, client):
    seeded = seed_run(settings)
    body = batch_body(3, seed=5)
    body["examples"][0] |= {"advantage": [0.5, -0.25, 1.0], "teacher_logprobs": [-1.0, -2.0, -0.5]}
    body["examples"][1] |= {"weights": [1.0, 0.5, 0.0], "reward": 0.75, "metrics": {"ok": 1.0}}
    binary = encode(to_arrays(batch_json_decoder.decode(msgspec.json.encode(body))))  # what the SDK sends

    from_json = post_batch(client, seeded, body)
    from_binary = client.post(
        f"/v1/runs/{seeded.run_id}/batches",
        content=binary,
        headers=seeded.headers | {"Content-Type": MSGPACK},
    )
    assert from_json.status_code == from_binary.status_code == 201, (from_json.text, from_binary.text)
    json_data, json_hash, _ = _stored(settings, from_json.json()["id"])
    binary_data, binary_hash, binary_sha = _stored(settings, from_binary.json()["id"])
    assert json_data == binary_data == binary  # the binary body is stored as received
    assert json_hash == binary_hash == binary_sha == hashlib.sha256(binary).hexdigest()
    assert from_json.json()["num_tokens"] == from_binary.json()["num_tokens"] == 21


def test_json_then_binary_with_one_key_is_a_replay(settings, client):
    seeded = seed_run(settings)
    body = batch_body(2, seed=1)
    first = post_batch(client, seeded, body, key="k1")
    # The binary form as the SDK encodes it (canonical: the bytes a JSON body is stored as).
    sdk_bytes = encode(to_arrays(batch_json_decoder.decode(msgspec.json.encode(body))))
    again = client.post(
        f"/v1/runs/{seeded.run_id}/batches",
        content=sdk_bytes,
        headers=seeded.headers | {"Content-Type": MSGPACK, "Idempotency-Key": "k1"},
    )
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert batch_count(settings) == 1
    other = binary_body(batch_body(2, seed=2))
    assert post_binary(client, seeded, other, key="k1").json()["error"]["code"] == "idempotency_conflict"


_BINARY_ONLY = [
    Bad(
        "ids_misaligned",
        lambda b: b["examples"][1].update(prompt_ids=b"\x01\x00\x00\x00\x02"),
        1,
        "prompt_ids",
    ),
    Bad(
        "logprobs_misaligned",
        lambda b: b["examples"][1].update(completion_logprobs=b"\x00\x00\x80\xbf" * 2 + b"\x00"),
        1,
        "completion_logprobs",
    ),
    Bad(
        "mask_value_two",
        lambda b: b["examples"][1].update(completion_mask=b"\x01\x02\x01"),
        1,
        "completion_mask",
    ),
    Bad(
        "ids_wrong_array_length",
        lambda b: b["examples"][1].update(completion_logprobs=np.zeros(5, FLOAT_DTYPE).tobytes()),
        1,
        "completion_logprobs",
    ),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_every_bad_input_in_binary_form_gets_the_same_4xx(settings, client, validating_run, case):  # noqa: F811
    seeded = validating_run
    rows_before, files_before = batch_count(settings), rollout_files(settings)
    body = batch_body(3)
    case.mutate(body)

    as_lists = post_batch(client, seeded, body, msgpack=True)
    binary = binary_body(body)
    as_binary = post_binary(client, seeded, binary)

    assert as_binary.status_code == as_lists.status_code == 422, as_binary.text
    lists_error, binary_error = as_lists.json()["error"], as_binary.json()["error"]
    assert binary_error["code"] == lists_error["code"] == "validation_error"
    where = {(d["sample"], d["field"]) for d in binary_error["details"]}
    assert (case.sample, case.field) in where, binary_error
    mixed = any(isinstance(v, list) for s in binary.get("examples", []) for v in s.values())
    if not mixed:  # a wrong type left as a list: each decoder names the first sample it cannot read
        assert where == {(d["sample"], d["field"]) for d in lists_error["details"]}
    assert (batch_count(settings), rollout_files(settings)) == (rows_before, files_before)


@pytest.mark.parametrize("case", _BINARY_ONLY, ids=[c.name for c in _BINARY_ONLY])
def test_faults_only_the_binary_form_has(settings, client, validating_run, case):  # noqa: F811
    seeded = validating_run
    rows_before = batch_count(settings)
    body = binary_body(batch_body(3))
    case.mutate(body)
    resp = post_binary(client, seeded, body)
    assert resp.status_code == 422, resp.text
    details = resp.json()["error"]["details"]
    assert {"sample": case.sample, "field": case.field} in [
        {"sample": d["sample"], "field": d["field"]} for d in details
    ]
    assert batch_count(settings) == rows_before


def test_binary_out_of_vocab_and_nan_are_named(settings, client, validating_run):  # noqa: F811
    body = binary_body(batch_body(3))
    body["examples"][2]["completion_ids"] = np.asarray([1, 2, 100], IDS_DTYPE).tobytes()
    body["examples"][1]["completion_logprobs"] = np.asarray([-1.0, math.nan, -1.0], FLOAT_DTYPE).tobytes()
    resp = post_binary(client, validating_run, body)
    assert resp.status_code == 422
    details = resp.json()["error"]["details"]
    assert [(d["sample"], d["field"]) for d in details] == [(1, "completion_logprobs"), (2, "completion_ids")]
    assert "nan at position 1" in details[0]["problem"]
    assert "100 at position 2" in details[1]["problem"] and "[0, 100)" in details[1]["problem"]


def test_binary_payload_stored_as_received_and_served_as_stored(settings, client):
    from tests.app.api import WORKER_HEADERS
    from tests.app.factories import add_pool

    pool_id = add_pool(settings)
    seeded = seed_run(settings)
    body = binary_body(batch_body(2, seed=4))
    raw = msgspec.msgpack.encode(body)  # not the SDK's key order: stored as received all the same
    resp = client.post(
        f"/v1/runs/{seeded.run_id}/batches", content=raw, headers=seeded.headers | {"Content-Type": MSGPACK}
    )
    assert resp.status_code == 201, resp.text
    data, digest, _ = _stored(settings, resp.json()["id"])
    assert data == raw and digest == hashlib.sha256(raw).hexdigest()
    claim = client.post(
        "/v1/pool/batches/claim",
        json={"pool_id": pool_id, "max_batches": 1},
        headers=WORKER_HEADERS | {"Accept": MSGPACK},
    )
    assert raw in claim.content  # spliced in, byte for byte
    with committed(settings) as session:
        assert session.scalars(select(Batch.state)).one() == "claimed"
