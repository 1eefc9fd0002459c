"""Rollout batch ingestion: POST/GET /v1/runs/{run_id}/batches (JSON and msgpack), validation,
idempotency, run-state conflicts. Real Postgres (or SQLite) through the fixtures."""

import fcntl
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from sqlalchemy import select

from app.batches.models import Batch
from app.batches.service import vocab_size_for
from app.batches.storage import remove_orphan_payloads, rollouts_dir
from app.batches.validation import decode_and_validate
from app.runs.models import Run
from contracts.arrays import decode_stored, to_lists
from contracts.run_config import RunConfig
from contracts.wire import (
    MAX_EXAMPLES_PER_BATCH,
    TrainingBatch,
    TrainingSample,
    batch_json_decoder,
    msgpack_encoder,
)
from tests.app.api import MSGPACK, WORKER_HEADERS, as_plain, batch_body, post_batch, sample, stored_plain
from tests.app.factories import Seeded, add_pool, batch_count, committed, rollout_files, seed_run

# --------------------------------------------------------------------------- happy path


@pytest.mark.parametrize("msgpack", [False, True], ids=["json", "msgpack"])
def test_submit_stores_payload_and_row(settings, client, msgpack):
    seeded = seed_run(settings)
    bodies = [batch_body(3, seed=0), batch_body(2, seed=10, step=0, env="math", agent="solver")]
    bodies[1]["examples"][0]["advantage"] = [0.1, -0.2, 0.3]
    bodies[1]["examples"][1]["teacher_logprobs"] = [-1.0, -2.0, -0.0]

    ids = []
    for body in bodies:
        resp = post_batch(client, seeded, body, msgpack=msgpack)
        assert resp.status_code == 201, resp.text
        out = resp.json()
        assert out["run_id"] == seeded.run_id
        assert out["state"] == "pending"
        assert out["trained_step"] is None
        assert out["num_samples"] == len(body["examples"])
        assert out["num_tokens"] == sum(
            len(s["prompt_ids"]) + len(s["completion_ids"]) for s in body["examples"]
        )
        assert out["rollout_step"] == body["step"]
        assert set(out) == {
            "id",
            "run_id",
            "rollout_step",
            "num_samples",
            "num_tokens",
            "state",
            "trained_step",
            "created_at",
        }
        ids.append(out["id"])

    with committed(settings) as session:
        rows = session.scalars(select(Batch).order_by(Batch.id)).all()
        assert [r.id for r in rows] == ids
        assert [r.sample_offset for r in rows] == [0, 3]
        assert session.get(Run, seeded.run_id).submitted_samples == 5
        for row, body in zip(rows, bodies, strict=True):
            path = settings.data_dir / row.payload_path
            assert path.parent == settings.runs_dir / seeded.run_id / "rollouts" / f"step_{body['step']}"
            assert path.name.startswith("batch_") and path.suffix == ".msgpack"
            data = path.read_bytes()
            assert hashlib.sha256(data).hexdigest() == row.payload_sha256 == row.request_hash
            assert row.payload_bytes == len(data)
            assert stored_plain(data) == as_plain(body)
    assert not [p for p in rollout_files(settings) if p.name.endswith(".tmp")]


def test_list_batches_state_filter_and_pagination(settings, client):
    seeded = seed_run(settings)
    ids = [post_batch(client, seeded, batch_body(1, seed=i)).json()["id"] for i in range(5)]
    with committed(settings) as session:
        first = session.get(Batch, ids[0])
        first.state, first.trained_step = "trained", 1
        session.get(Batch, ids[1]).state = "claimed"

    url = f"/v1/runs/{seeded.run_id}/batches"
    page = client.get(url, headers=seeded.headers).json()
    assert [b["id"] for b in page["items"]] == ids and page["next_cursor"] is None
    assert [b["state"] for b in page["items"]] == ["trained", "claimed", "pending", "pending", "pending"]
    assert page["items"][0]["trained_step"] == 1

    got, cursor = [], None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get(url, params=params, headers=seeded.headers).json()
        got += [b["id"] for b in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert got == ids

    pending = client.get(url, params={"state": "pending"}, headers=seeded.headers).json()
    assert [b["id"] for b in pending["items"]] == ids[2:]
    assert client.get(url, params={"state": "bogus"}, headers=seeded.headers).status_code == 422
    assert client.get(url, params={"cursor": "x!"}, headers=seeded.headers).status_code == 422


def test_other_tenant_and_auth(settings, client):
    mine = seed_run(settings)
    theirs = seed_run(settings)
    url = f"/v1/runs/{theirs.run_id}/batches"
    for resp in (
        client.post(url, json=batch_body(), headers=mine.headers),
        client.get(url, headers=mine.headers),
        client.post("/v1/runs/run_000000000000/batches", json=batch_body(), headers=mine.headers),
        client.post("/v1/runs/..%2Fetc/batches", json=batch_body(), headers=mine.headers),
    ):
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["code"] == "not_found"
    assert client.post(url, json=batch_body()).status_code == 401
    # The worker token is not a tenant key.
    assert client.post(url, json=batch_body(), headers=WORKER_HEADERS).status_code == 401
    assert batch_count(settings) == 0


def test_openapi_documents_json_and_msgpack(client):
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/v1/runs/{run_id}/batches"]["post"]
    assert op["operationId"] == "submitBatch"
    content = op["requestBody"]["content"]
    assert set(content) == {"application/json", "application/msgpack"}
    assert content["application/msgpack"]["schema"] == {"$ref": "#/components/schemas/TrainingBatch"}
    schemas = spec["components"]["schemas"]
    assert schemas["TrainingBatch"]["required"] == ["examples"]
    assert schemas["TrainingBatch"]["properties"]["examples"]["items"] == {
        "$ref": "#/components/schemas/TrainingSample"
    }
    assert "prompt_ids" in schemas["TrainingSample"]["properties"]
    assert spec["paths"]["/v1/runs/{run_id}/batches"]["get"]["operationId"] == "listBatches"


# --------------------------------------------------------------------------- bad input: one table, every rule

NAN, INF = float("nan"), float("inf")

Mutation = Callable[[dict[str, Any]], None]


def _set_sample(index: int, **fields: Any) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        body["examples"][index].update(fields)

    return mutate


def _del_sample(index: int, field: str) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        del body["examples"][index][field]

    return mutate


def _set_batch(**fields: Any) -> Mutation:
    def mutate(body: dict[str, Any]) -> None:
        body.update(fields)

    return mutate


@dataclass(frozen=True)
class Bad:
    name: str
    mutate: Mutation
    sample: int | None
    field: str
    msgpack: bool = False
    """msgpack carries NaN/inf; JSON cannot."""


# The sample at fault is index 1 of 3 throughout, so the tests see that the index is named.
BAD_INPUTS = [
    Bad("no_examples", _set_batch(examples=[]), None, "examples"),
    Bad(
        "too_many_examples",
        _set_batch(examples=[sample(1, 1)] * (MAX_EXAMPLES_PER_BATCH + 1)),
        None,
        "examples",
    ),
    Bad("temperature_zero", _set_batch(temperature=0.0), None, "temperature"),
    Bad("temperature_negative", _set_batch(temperature=-1.0), None, "temperature"),
    Bad("temperature_nan", _set_batch(temperature=NAN), None, "temperature", msgpack=True),
    Bad("temperature_inf", _set_batch(temperature=INF), None, "temperature", msgpack=True),
    # 0 and inf in the trainer's float32 (that run's loss went non-finite).
    Bad("temperature_subnormal", _set_batch(temperature=5e-324), None, "temperature"),
    Bad("temperature_huge", _set_batch(temperature=1e308), None, "temperature"),
    Bad("step_negative", _set_batch(step=-1), None, "step"),
    Bad("step_beyond_int32", _set_batch(step=2**31), None, "step"),  # a 32-bit column
    Bad("env_nul", _set_batch(env="e\x00"), None, "env", msgpack=True),  # JSON: the request guard's 422
    Bad("env_too_long", _set_batch(env="e" * 1000), None, "env"),
    Bad("empty_prompt", _set_sample(1, prompt_ids=[], prompt_mask=[]), 1, "prompt_ids"),
    Bad(
        "empty_completion",
        _set_sample(1, completion_ids=[], completion_mask=[], completion_logprobs=[], advantage=1.0),
        1,
        "completion_ids",
    ),
    Bad("prompt_mask_length", _set_sample(1, prompt_mask=[False] * 3), 1, "prompt_mask"),
    Bad("completion_mask_length", _set_sample(1, completion_mask=[True] * 4), 1, "completion_mask"),
    Bad("logprobs_length", _set_sample(1, completion_logprobs=[-1.0]), 1, "completion_logprobs"),
    Bad("advantage_missing", _del_sample(1, "advantage"), 1, "advantage"),
    Bad("advantage_null", _set_sample(1, advantage=None), 1, "advantage"),
    Bad("advantage_list_length", _set_sample(1, advantage=[0.1, 0.2]), 1, "advantage"),
    Bad("advantage_nan", _set_sample(1, advantage=NAN), 1, "advantage", msgpack=True),
    Bad("advantage_list_inf", _set_sample(1, advantage=[0.1, INF, 0.3]), 1, "advantage", msgpack=True),
    Bad("teacher_length", _set_sample(1, teacher_logprobs=[-1.0, -1.0]), 1, "teacher_logprobs"),
    Bad("teacher_positive", _set_sample(1, teacher_logprobs=[-1.0, 0.5, -1.0]), 1, "teacher_logprobs"),
    Bad(
        "teacher_nan", _set_sample(1, teacher_logprobs=[-1.0, NAN, -1.0]), 1, "teacher_logprobs", msgpack=True
    ),
    Bad("logprob_positive", _set_sample(1, completion_logprobs=[-1.0, 0.1, -1.0]), 1, "completion_logprobs"),
    Bad(
        "logprob_nan",
        _set_sample(1, completion_logprobs=[-1.0, NAN, -1.0]),
        1,
        "completion_logprobs",
        msgpack=True,
    ),
    Bad(
        "logprob_neg_inf",
        _set_sample(1, completion_logprobs=[-INF, -1.0, -1.0]),
        1,
        "completion_logprobs",
        True,
    ),
    Bad(
        "over_seq_len",
        _set_sample(1, prompt_ids=[1] * 62, prompt_mask=[False] * 62),
        1,
        "prompt_ids+completion_ids",
    ),
    Bad("prompt_token_negative", _set_sample(1, prompt_ids=[1, -5, 2, 3]), 1, "prompt_ids"),
    Bad("completion_token_negative", _set_sample(1, completion_ids=[1, 2, -1]), 1, "completion_ids"),
    Bad("prompt_token_outside_vocab", _set_sample(1, prompt_ids=[1, 2, 100, 3]), 1, "prompt_ids"),
    Bad("completion_token_outside_vocab", _set_sample(1, completion_ids=[1, 2, 10**6]), 1, "completion_ids"),
    Bad("token_wrong_type", _set_sample(1, prompt_ids=[1, "a", 2, 3]), 1, "prompt_ids"),
    Bad("mask_wrong_type", _set_sample(1, prompt_mask=[0, 0, 0, 0]), 1, "prompt_mask"),
    Bad("reward_nan", _set_sample(1, reward=NAN), 1, "reward", msgpack=True),
    # Finite, but the per-step statistics' squared deviations would overflow (a 500 and a poisoned step).
    Bad("reward_beyond_float32", _set_sample(1, reward=1e200), 1, "reward"),
    Bad("token_rewards_length", _set_sample(1, token_rewards=[1.0]), 1, "token_rewards"),
    Bad("token_rewards_inf", _set_sample(1, token_rewards=[0.0, INF, 0.0]), 1, "token_rewards", msgpack=True),
    Bad("weights_length", _set_sample(1, weights=[1.0, 1.0]), 1, "weights"),
    Bad("weights_negative", _set_sample(1, weights=[1.0, -0.5, 1.0]), 1, "weights"),
    Bad("metrics_too_many", _set_sample(1, metrics={f"m{i}": 1.0 for i in range(17)}), 1, "metrics"),
    Bad("metric_name_empty", _set_sample(1, metrics={"": 1.0}), 1, "metrics"),
    Bad("metric_nan", _set_sample(1, metrics={"ok": NAN}), 1, "metrics", msgpack=True),
    Bad("metric_beyond_float32", _set_sample(1, metrics={"ok": -1e300}), 1, "metrics"),
    Bad("metric_name_nul", _set_sample(1, metrics={"a\x00b": 1.0}), 1, "metrics", msgpack=True),
    Bad("unknown_sample_field", _set_sample(1, score=1.0), 1, "score"),
    Bad("missing_sample_field", _del_sample(1, "completion_mask"), 1, "completion_mask"),
    Bad("unknown_batch_field", _set_batch(rewards=[1]), None, "rewards"),
    Bad("temperature_wrong_type", _set_batch(temperature="hot"), None, "temperature"),
]


@pytest.fixture
def validating_run(settings):
    """A run with seq_len 64 on a base model whose pool reports a vocabulary of 100 tokens, holding one batch."""
    add_pool(settings, vocab_size=100)
    seeded = seed_run(settings, config=RunConfig(seq_len=64))
    return seeded


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.name for c in BAD_INPUTS])
def test_bad_input_rejected_whole_and_nothing_stored(settings, client, validating_run, case):
    seeded = validating_run
    assert post_batch(client, seeded, batch_body(2, seed=99)).status_code == 201
    rows_before, files_before = batch_count(settings), rollout_files(settings)

    body = batch_body(3)
    case.mutate(body)
    resp = post_batch(client, seeded, body, msgpack=case.msgpack, key=f"bad-{case.name}")

    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["code"] == "validation_error"
    assert {"sample": case.sample, "field": case.field} in [
        {"sample": d["sample"], "field": d["field"]} for d in error["details"]
    ], error
    assert all(d["problem"] for d in error["details"])
    assert batch_count(settings) == rows_before
    assert rollout_files(settings) == files_before
    with committed(settings) as session:
        assert session.get(Run, seeded.run_id).submitted_samples == 2
    # A corrected retry with the same key is a new request, not a replay of the rejected one.
    assert post_batch(client, seeded, batch_body(3), key=f"bad-{case.name}").status_code == 201


@pytest.mark.parametrize(
    ("name", "content", "content_type", "status"),
    [
        ("malformed_json", b'{"examples": [', "application/json", 422),
        ("malformed_msgpack", b"\xc1\xc1", MSGPACK, 422),
        ("msgpack_string_not_utf8", b"\x81\xa2\xff\xfe\x00", MSGPACK, 422),
        ("empty_body", b"", "application/json", 422),
        ("json_array", b"[1, 2]", "application/json", 422),
        ("unsupported_type", b"examples=1", "application/x-www-form-urlencoded", 415),
    ],
)
def test_undecodable_body_rejected(settings, client, name, content, content_type, status):
    seeded = seed_run(settings)
    headers = seeded.headers | {"Content-Type": content_type}
    resp = client.post(f"/v1/runs/{seeded.run_id}/batches", content=content, headers=headers)
    assert resp.status_code == status, resp.text
    if status == 422:
        assert resp.json()["error"]["details"][0]["field"] == "body"
    assert batch_count(settings) == 0 and rollout_files(settings) == []


def test_every_problem_is_listed(settings, client):
    seeded = seed_run(settings, config=RunConfig(seq_len=64))
    body = batch_body(4, temperature=0.0)
    body["examples"][0]["completion_logprobs"] = [0.5, -1.0, -1.0]
    body["examples"][2]["prompt_mask"] = [True]
    body["examples"][3]["advantage"] = None
    error = post_batch(client, seeded, body).json()["error"]
    assert [(d["sample"], d["field"]) for d in error["details"]] == [
        (None, "temperature"),
        (0, "completion_logprobs"),
        (2, "prompt_mask"),
        (3, "advantage"),
    ]


def test_rewards_weights_and_metrics_are_stored_as_sent(settings, client):
    seeded = seed_run(settings)
    body = batch_body(2)
    body["examples"][0] |= {"reward": 0.75, "metrics": {"format_ok": 1.0}, "weights": [1.0, 0.5, 0.0]}
    body["examples"][1] |= {"token_rewards": [0.0, 0.0, 1.0]}
    assert post_batch(client, seeded, body).status_code == 201
    with committed(settings) as session:
        batch = session.scalars(select(Batch)).one()
        stored = to_lists(decode_stored((settings.data_dir / batch.payload_path).read_bytes()))
    first, second = stored.examples
    assert (first.reward, first.metrics, first.weights) == (0.75, {"format_ok": 1.0}, [1.0, 0.5, 0.0])
    assert (second.reward, second.token_rewards) == (None, [0.0, 0.0, 1.0])


def test_no_pool_means_no_upper_vocab_bound(settings, client):
    seeded = seed_run(settings)
    body = batch_body(1)
    body["examples"][0]["completion_ids"] = [1, 2, 10**9]
    assert post_batch(client, seeded, body).status_code == 201


# --------------------------------------------------------------------------- run state: 409s


@pytest.mark.parametrize("status", ["queued", "completed", "failed", "deleted"])
def test_inactive_run_conflict(settings, client, status):
    seeded = seed_run(settings, status=status)
    resp = post_batch(client, seeded, batch_body())
    assert resp.status_code == 409
    error = resp.json()["error"]
    assert error["code"] == "run_not_active"
    assert error["details"] == {"status": status}
    assert batch_count(settings) == 0 and rollout_files(settings) == []


def test_evicted_run_conflict_carries_reason(settings, client):
    seeded = seed_run(settings, status="evicted", eviction_reason="NaN loss at step 3", evicted_by="trainer")
    resp = post_batch(client, seeded, batch_body())
    assert resp.status_code == 409
    error = resp.json()["error"]
    assert error["code"] == "run_evicted"
    assert error["details"] == {"reason": "NaN loss at step 3", "evicted_by": "trainer"}
    assert "NaN loss at step 3" in error["message"]
    assert batch_count(settings) == 0 and rollout_files(settings) == []


def test_stale_batch_conflict(settings, client):
    seeded = seed_run(settings, config=RunConfig(max_async_level=2), step=10)
    resp = post_batch(client, seeded, batch_body(step=7))
    assert resp.status_code == 409
    error = resp.json()["error"]
    assert error["code"] == "stale_batch"
    assert error["details"] == {"rollout_step": 7, "run_step": 10, "max_async_level": 2}
    assert batch_count(settings) == 0 and rollout_files(settings) == []
    assert post_batch(client, seeded, batch_body(step=8)).status_code == 201


# --------------------------------------------------------------------------- idempotency


def test_repeated_key_stores_once(settings, client):
    seeded = seed_run(settings)
    body = batch_body(3)
    first = post_batch(client, seeded, body, key="k-1")
    assert first.status_code == 201
    again = post_batch(client, seeded, body, key="k-1")
    assert again.status_code == 200 and again.json() == first.json()
    # The same batch as msgpack is the same request.
    as_msgpack = post_batch(client, seeded, body, key="k-1", msgpack=True)
    assert as_msgpack.status_code == 200 and as_msgpack.json() == first.json()
    assert batch_count(settings) == 1 and len(rollout_files(settings)) == 1
    with committed(settings) as session:
        assert session.get(Run, seeded.run_id).submitted_samples == 3

    other = post_batch(client, seeded, batch_body(3, seed=5), key="k-1")
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_conflict"
    assert batch_count(settings) == 1 and len(rollout_files(settings)) == 1

    # Keys are per run.
    second_run = seed_run(settings, tenant_id=seeded.tenant_id)
    assert (
        post_batch(
            client, Seeded(seeded.tenant_id, seeded.secret, second_run.run_id), body, key="k-1"
        ).status_code
        == 201
    )


def test_replay_after_eviction_returns_the_stored_batch(settings, client):
    seeded = seed_run(settings)
    first = post_batch(client, seeded, batch_body(), key="k")
    with committed(settings) as session:
        run = session.get(Run, seeded.run_id)
        run.status, run.eviction_reason, run.evicted_by = "evicted", "done", "user"
    again = post_batch(client, seeded, batch_body(), key="k")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]


@pytest.mark.postgres_only
def test_concurrent_identical_requests_store_once(settings, client):
    seeded = seed_run(settings)
    body = batch_body(4)
    n = 8
    barrier = threading.Barrier(n)
    responses: list[Any] = [None] * n

    def send(i: int) -> None:
        barrier.wait()
        responses[i] = post_batch(client, seeded, body, key="same", msgpack=i % 2 == 1)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * (n - 1) + [201], [r.text for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    assert batch_count(settings) == 1
    assert len(rollout_files(settings)) == 1  # the losers' files were discarded
    with committed(settings) as session:
        assert session.get(Run, seeded.run_id).submitted_samples == 4


@pytest.mark.postgres_only
def test_concurrent_submissions_get_disjoint_offsets(settings, client):
    seeded = seed_run(settings)
    n = 8
    barrier = threading.Barrier(n)
    codes: list[int] = []

    def send(i: int) -> None:
        barrier.wait()
        codes.append(post_batch(client, seeded, batch_body(i + 1, seed=i)).status_code)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [201] * n
    with committed(settings) as session:
        rows = session.scalars(select(Batch).order_by(Batch.id)).all()
        offset = 0
        for row in rows:  # contiguous, in id order
            assert row.sample_offset == offset
            offset += row.num_samples
        assert offset == sum(range(1, n + 1)) == session.get(Run, seeded.run_id).submitted_samples


# --------------------------------------------------------------------------- decoding and storage internals


def test_constrained_decode_is_the_wire_type():
    """The fast-path decoder only narrows types: same fields, same struct, same bytes."""
    body = batch_body(3)
    body["examples"][1]["advantage"] = [0.5, -0.5, 1.0]
    body["examples"][2]["teacher_logprobs"] = [-0.1, -0.2, -0.3]
    raw = msgspec.json.encode(body)
    fast = decode_and_validate(raw, msgpack=False, seq_len=64, vocab_size=100)
    plain = batch_json_decoder.decode(raw)
    assert isinstance(fast, TrainingBatch) and isinstance(fast.examples[0], TrainingSample)
    assert msgpack_encoder.encode(fast) == msgpack_encoder.encode(plain)
    assert msgspec.structs.fields(type(fast)) and [f.name for f in msgspec.structs.fields(type(fast))] == [
        f.name for f in msgspec.structs.fields(TrainingBatch)
    ]
    assert [f.name for f in msgspec.structs.fields(type(fast.examples[0]))] == [
        f.name for f in msgspec.structs.fields(TrainingSample)
    ]


def test_vocab_size_for_prefers_the_live_pool(settings):
    with committed(settings) as session:
        assert vocab_size_for(session, base_model="loraloom-tiny") is None
    add_pool(settings, vocab_size=500, status="dead")
    with committed(settings) as session:
        assert vocab_size_for(session, base_model="loraloom-tiny") == 500
    add_pool(settings, vocab_size=700)
    add_pool(settings, vocab_size=900, status="stopped")
    with committed(settings) as session:
        assert vocab_size_for(session, base_model="loraloom-tiny") == 700
        assert vocab_size_for(session, base_model="other") is None


def test_orphan_payloads_are_removed_whatever_their_age_but_not_while_written(settings, client):
    seeded = seed_run(settings)
    assert post_batch(client, seeded, batch_body()).status_code == 201
    orphan_dir = rollouts_dir(settings, seeded.run_id) / "step_0"
    crashed = orphan_dir / "batch_0123456789abcdef0123456789abcdef.msgpack"
    in_flight = orphan_dir / "batch_fedcba9876543210fedcba9876543210.msgpack"
    crashed.write_bytes(b"left by a crash between the file and the commit (seconds ago)")
    in_flight.write_bytes(b"a request on another process, its commit still to come")
    writer = os.open(in_flight, os.O_RDONLY)
    fcntl.flock(writer, fcntl.LOCK_SH)  # what write_payload holds until the transaction ends
    try:
        with committed(settings) as session:
            assert remove_orphan_payloads(session, settings=settings) == 1
        assert not crashed.exists() and in_flight.exists()
    finally:
        os.close(writer)
    with committed(settings) as session:
        assert remove_orphan_payloads(session, settings=settings) == 1  # its writer is gone now
    assert len(rollout_files(settings)) == 1  # the committed batch's file stays


def test_replay_after_the_run_moved_on(settings, client):
    seeded = seed_run(settings, config=RunConfig(max_async_level=1))
    first = post_batch(client, seeded, batch_body(step=0), key="k")
    with committed(settings) as session:
        session.get(Run, seeded.run_id).step = 5
    # Stale now, but a retry of the accepted request is still its replay; a new one is refused.
    again = post_batch(client, seeded, batch_body(step=0), key="k")
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    assert post_batch(client, seeded, batch_body(step=0), key="k2").json()["error"]["code"] == "stale_batch"
    with committed(settings) as session:
        session.get(Run, seeded.run_id).status = "completed"
    # A stopped run answers 409 (not 422) even to a body it cannot decode.
    resp = client.post(
        f"/v1/runs/{seeded.run_id}/batches",
        content=b"{not json",
        headers=seeded.headers | {"Idempotency-Key": "k", "Content-Type": "application/json"},
    )
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "run_not_active"
    assert batch_count(settings) == 1 and len(rollout_files(settings)) == 1
