"""Bad input, table-driven: every case gets a clear 4xx in the uniform error body, and
nothing is stored (row counts and files unchanged)."""

import base64
import json

import msgspec
import pytest
from fastapi.testclient import TestClient

from app.batches.models import Batch
from app.events.models import Event
from app.main import create_app
from app.runs.models import Run
from app.tenants.models import ApiKey, Tenant
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, create_run, new_tenant
from tests.app.factories import row_counts

JSON = {"Content-Type": "application/json"}
TOML = {"Content-Type": "application/toml"}

# (case id, method, url, headers, body bytes, expected status, expected code, a field path that must be reported)
CASES = [
    ("malformed-json", "POST", "/v1/runs", JSON, b'{"name": "x",', 422, "validation_error", "body"),
    ("empty-json", "POST", "/v1/runs", JSON, b"", 422, "validation_error", "body"),
    ("json-not-object", "POST", "/v1/runs", JSON, b"[1, 2]", 422, "validation_error", "body"),
    ("malformed-toml", "POST", "/v1/runs", TOML, b'name = "x\n[config', 422, "validation_error", "body"),
    ("toml-not-utf8", "POST", "/v1/runs", TOML, b'name = "\xff\xfe"', 422, "validation_error", "body"),
    (
        "unknown-top-field",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "bogus": 1}',
        422,
        "validation_error",
        "body.bogus",
    ),
    (
        "unknown-nested-field",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"lora": {"rank": 8, "ranks": 4}}}',
        422,
        "validation_error",
        "body.config.lora.ranks",
    ),
    (
        "unknown-toml-field",
        "POST",
        "/v1/runs",
        TOML,
        b'name = "x"\n[config]\nmax_step = 3\n',
        422,
        "validation_error",
        "body.config.max_step",
    ),
    (
        "rank-zero",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"lora": {"rank": 0}}}',
        422,
        "validation_error",
        "body.config.lora.rank",
    ),
    (
        "lr-negative",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"optim": {"lr": -1}}}',
        422,
        "validation_error",
        "body.config.optim.lr",
    ),
    (
        "max-steps-huge",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"max_steps": 1e12}}',
        422,
        "validation_error",
        "body.config.max_steps",
    ),
    (
        "wrong-type",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"batch_size": "eight"}}',
        422,
        "validation_error",
        "body.config.batch_size",
    ),
    (
        "bad-enum",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"scheduler": {"kind": "exp"}}}',
        422,
        "validation_error",
        "body.config.scheduler.kind",
    ),
    ("missing-name", "POST", "/v1/runs", JSON, b'{"config": {}}', 422, "validation_error", "body.name"),
    (
        "control-chars-in-name",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "a\\u0000b"}',
        422,
        "validation_error",
        "body.name",
    ),
    (
        "unsupported-media-type",
        "POST",
        "/v1/runs",
        {"Content-Type": "text/plain"},
        b"name=x",
        415,
        "unsupported_media_type",
        None,
    ),
    (
        "idempotency-key-too-long",
        "POST",
        "/v1/runs",
        {**JSON, "Idempotency-Key": "k" * 129},
        b'{"name": "x"}',
        422,
        "validation_error",
        "header.Idempotency-Key",
    ),
    ("dotdot-run-id-encoded", "GET", "/v1/runs/..%2Fetc", {}, None, 404, "not_found", None),
    ("dotdot-run-id", "GET", "/v1/runs/../etc", {}, None, 404, "not_found", None),
    (
        "dotdot-run-id-evict",
        "POST",
        "/v1/runs/..%2F..%2Fetc/evict",
        JSON,
        b'{"reason": "x"}',
        404,
        "not_found",
        None,
    ),
    ("dotdot-run-id-delete", "DELETE", "/v1/runs/run_..%2F..%2Fetc", {}, None, 404, "not_found", None),
    ("uppercase-run-id", "GET", "/v1/runs/RUN_0123456789AB", {}, None, 404, "not_found", None),
    ("limit-zero", "GET", "/v1/runs?limit=0", {}, None, 422, "validation_error", "query.limit"),
    ("limit-too-big", "GET", "/v1/runs?limit=201", {}, None, 422, "validation_error", "query.limit"),
    ("bad-cursor", "GET", "/v1/runs?cursor=%%%", {}, None, 422, "validation_error", "query.cursor"),
    ("bad-status", "GET", "/v1/runs?status=running", {}, None, 422, "validation_error", "query.status"),
    ("evict-no-reason", "POST", "/v1/runs/{run}/evict", JSON, b"{}", 422, "validation_error", "body.reason"),
    (
        "evict-empty-reason",
        "POST",
        "/v1/runs/{run}/evict",
        JSON,
        b'{"reason": ""}',
        422,
        "validation_error",
        "body.reason",
    ),
    (
        "evict-bad-by",
        "POST",
        "/v1/runs/{run}/evict",
        JSON,
        b'{"reason": "x", "by": "admin"}',
        422,
        "validation_error",
        "body.by",
    ),
    ("evict-malformed", "POST", "/v1/runs/{run}/evict", JSON, b'{"reason":', 422, "validation_error", "body"),
]


# Issue 10's hostile inputs (each was a text/plain 500 before). Batch problems are reported with a
# `loc` like every 422's (and with {sample, field, problem} besides).
MSGPACK = {"Content-Type": "application/msgpack"}
WORKER_JSON = {**WORKER_HEADERS, **JSON}
INT32 = 2**31
INT64 = 2**63


def _batch(step: int = 0, token: int = 1) -> dict:
    sample = {
        "prompt_ids": [1, 2],
        "prompt_mask": [True, True],
        "completion_ids": [token],
        "completion_mask": [True],
        "completion_logprobs": [-0.5],
        "advantage": 1.0,
    }
    return {"examples": [sample], "step": step}


def _json(value: object) -> bytes:
    return json.dumps(value).encode()


def _cursor(created: str, item_id: object) -> str:
    raw = json.dumps([created, item_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _nested(depth: int) -> bytes:
    return b'{"name": "x", "config": {"metadata": {"deep": ' + b"[" * depth + b"]" * depth + b"}}}"


NOW = "2026-01-01T00:00:00+00:00"
BATCHES = "/v1/runs/{run}/batches"
HOSTILE_CASES = [
    (
        "batch-step-2^31",
        "POST",
        BATCHES,
        JSON,
        _json(_batch(step=INT32)),
        422,
        "validation_error",
        "body.step",
    ),
    (
        "batch-step-2^31-msgpack",
        "POST",
        BATCHES,
        MSGPACK,
        msgspec.msgpack.encode(_batch(step=INT32)),
        422,
        "validation_error",
        "body.step",
    ),
    (
        "token-id-2^64",
        "POST",
        BATCHES,
        JSON,
        _json(_batch(token=2**64)),
        422,
        "validation_error",
        "body.examples.0.completion_ids",
    ),
    (
        "token-id-2^64-replay-path",
        "POST",
        BATCHES,
        {**JSON, "Idempotency-Key": "k1"},
        _json(_batch(token=2**64)),
        422,
        "validation_error",
        "body.examples.0.completion_ids",
    ),
    (
        "token-id-2^31-no-vocab",
        "POST",
        BATCHES,
        JSON,
        _json(_batch(token=INT32)),
        422,
        "validation_error",
        "body.examples.0.completion_ids",
    ),
    (
        "evict-reason-nul",
        "POST",
        "/v1/runs/{run}/evict",
        JSON,
        b'{"reason": "a\\u0000b"}',
        422,
        "validation_error",
        "body.reason",
    ),
    # An ANSI escape or a carriage return in a reason rewrote what `loraloom runs show` printed.
    (
        "evict-reason-ansi",
        "POST",
        "/v1/runs/{run}/evict",
        JSON,
        b'{"reason": "ok\\u001b[2K\\rdone by admin"}',
        422,
        "validation_error",
        "body.reason",
    ),
    (
        "base-model-nul",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"base_model": "m\\u0000"}}',
        422,
        "validation_error",
        "body.config.base_model",
    ),
    (
        "base-model-nul-toml",
        "POST",
        "/v1/runs",
        TOML,
        b'name = "x"\n[config]\nbase_model = "m\\u0000"\n',
        422,
        "validation_error",
        "body.config.base_model",
    ),
    (
        "metadata-key-nul",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"metadata": {"a\\u0000": 1}}}',
        422,
        "validation_error",
        "body.config.metadata",
    ),
    (
        "tenant-name-nul",
        "POST",
        "/v1/tenants",
        {**ADMIN_HEADERS, **JSON},
        b'{"name": "t\\u0000"}',
        422,
        "validation_error",
        "body.name",
    ),
    (
        "pool-id-nul-claim",
        "POST",
        "/v1/pool/batches/claim",
        WORKER_JSON,
        b'{"pool_id": "p\\u0000", "max_batches": 1}',
        422,
        "validation_error",
        "body.pool_id",
    ),
    (
        "tenant-id-nul-path",
        "GET",
        "/v1/tenants/ten_%00/keys",
        ADMIN_HEADERS,
        None,
        422,
        "validation_error",
        "path",
    ),
    ("run-id-nul-path", "GET", "/v1/runs/run_%00", {}, None, 422, "validation_error", "path"),
    ("cursor-nul", "GET", "/v1/runs?cursor=a%00b", {}, None, 422, "validation_error", "query.cursor"),
    (
        "metadata-null-in-list",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"metadata": {"tags": ["a", null]}}}',
        422,
        "validation_error",
        "body.config.metadata",
    ),
    (
        "metadata-int-past-64-bits",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"metadata": {"n": 99999999999999999999999}}}',
        422,
        "validation_error",
        "body.config.metadata",
    ),
    # Past Python's int() limit of 4300 digits: a plain ValueError from either parser (was a 500).
    (
        "json-int-5000-digits",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"seed": ' + b"1" * 5000 + b"}}",
        422,
        "validation_error",
        "body",
    ),
    (
        "toml-int-5000-digits",
        "POST",
        "/v1/runs",
        TOML,
        b'name = "x"\n[config]\nseed = ' + b"1" * 5000 + b"\n",
        422,
        "validation_error",
        "body",
    ),
    # A lone surrogate (no UTF-8 holds it) in metadata's Any-typed values or keys: was accepted, and
    # the run's response failed to serialise (500).
    (
        "metadata-lone-surrogate",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"metadata": {"a": ["ok", "\\ud800"]}}}',
        422,
        "validation_error",
        "body.config.metadata",
    ),
    (
        "metadata-key-lone-surrogate",
        "POST",
        "/v1/runs",
        JSON,
        b'{"name": "x", "config": {"metadata": {"\\udfff": 1}}}',
        422,
        "validation_error",
        "body.config.metadata",
    ),
    ("nested-1000-json", "POST", "/v1/runs", JSON, _nested(1000), 422, "validation_error", "body"),
    ("nested-900-json", "POST", "/v1/runs", JSON, _nested(900), 422, "validation_error", "body"),
    ("nested-1000-no-content-type", "POST", "/v1/runs", {}, _nested(1000), 422, "validation_error", "body"),
    (
        "nested-1000-toml",
        "POST",
        "/v1/runs",
        TOML,
        b'name = "x"\n[config.metadata]\ndeep = ' + b"[" * 1000 + b"]" * 1000 + b"\n",
        422,
        "validation_error",
        "body",
    ),
    (
        "nested-1000-evict",
        "POST",
        "/v1/runs/{run}/evict",
        JSON,
        b'{"reason": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        422,
        "validation_error",
        "body",
    ),
    (
        "nested-1000-batch",
        "POST",
        BATCHES,
        JSON,
        b'{"examples": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        422,
        "validation_error",
        "body.examples",  # msgspec fails the type at the 2nd level: no depth scan needed
    ),
    (
        "nested-100000-batch-msgpack",
        "POST",
        BATCHES,
        MSGPACK,
        b"\x81\xa8examples" + b"\x91" * 100_000 + b"\x90",
        422,
        "validation_error",
        "body.examples",
    ),
    (
        "nested-1000-pool",
        "POST",
        "/v1/pool/batches/ack",
        WORKER_JSON,
        b'{"pool_id": "p", "acks": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        422,
        "validation_error",
        "body",
    ),
    ("non-utf8-json", "POST", "/v1/runs", JSON, b'{"name": "\xff\xfe"}', 422, "validation_error", "body"),
    (
        "non-utf8-evict",
        "POST",
        "/v1/runs/{run}/evict",
        JSON,
        b'{"reason": "\xff"}',
        422,
        "validation_error",
        "body",
    ),
    (
        "list-runs-cursor-int-id",
        "GET",
        "/v1/runs?cursor=" + _cursor(NOW, 5),
        {},
        None,
        422,
        "validation_error",
        "query.cursor",
    ),
    (
        "list-runs-cursor-surrogate",
        "GET",
        "/v1/runs?cursor=" + _cursor(NOW, "\ud800"),
        {},
        None,
        422,
        "validation_error",
        "query.cursor",
    ),
    (
        "list-runs-cursor-date-overflow",
        "GET",
        "/v1/runs?cursor=" + _cursor("0001-01-01T00:00:00+05:00", "run_x"),
        {},
        None,
        422,
        "validation_error",
        "query.cursor",
    ),
    # A time whose offset moves it past year 9999 or before year 1 in UTC (was an OverflowError, 500).
    (
        "events-since-past-9999-in-utc",
        "GET",
        "/v1/runs/{run}/events?since=9999-12-31T23:59:59-23:59",
        {},
        None,
        422,
        "validation_error",
        "query.since",
    ),
    (
        "events-since-before-year-1-in-utc",
        "GET",
        "/v1/runs/{run}/events?since=0001-01-01T00:00:00%2B23:59",
        {},
        None,
        422,
        "validation_error",
        "query.since",
    ),
    (
        "list-batches-cursor-superscript",
        "GET",
        BATCHES + "?cursor=%C2%B2",
        {},
        None,
        422,
        "validation_error",
        "query.cursor",
    ),
    (
        "list-batches-cursor-2^31",
        "GET",
        BATCHES + f"?cursor={INT32}",
        {},
        None,
        422,
        "validation_error",
        "query.cursor",
    ),
    (
        "ack-batch-id-2^31",
        "POST",
        "/v1/pool/batches/ack",
        WORKER_JSON,
        _json({"pool_id": "p", "acks": [{"batch_id": INT32, "trained_step": 1}]}),
        422,
        "validation_error",
        "body.acks.0.batch_id",
    ),
    (
        "ack-trained-step-2^31",
        "POST",
        "/v1/pool/batches/ack",
        WORKER_JSON,
        _json({"pool_id": "p", "acks": [{"batch_id": 1, "trained_step": INT32}]}),
        422,
        "validation_error",
        "body.acks.0.trained_step",
    ),
    (
        "restart-checkpoint-step-2^31",
        "POST",
        "/v1/pool/runs/{run}/restart",
        WORKER_JSON,
        _json({"pool_id": "p", "checkpoint_step": INT32, "total_samples": 0, "total_tokens": 0}),
        422,
        "validation_error",
        "body.checkpoint_step",
    ),
    (
        "restart-total-samples-2^63",
        "POST",
        "/v1/pool/runs/{run}/restart",
        WORKER_JSON,
        _json({"pool_id": "p", "checkpoint_step": 0, "total_samples": INT64, "total_tokens": 0}),
        422,
        "validation_error",
        "body.total_samples",
    ),
    (
        "restart-total-tokens-2^63",
        "POST",
        "/v1/pool/runs/{run}/restart",
        WORKER_JSON,
        _json({"pool_id": "p", "checkpoint_step": 0, "total_samples": 0, "total_tokens": INT64}),
        422,
        "validation_error",
        "body.total_tokens",
    ),
    (
        "step-report-total-tokens-2^63",
        "POST",
        "/v1/pool/runs/{run}/steps",
        WORKER_JSON,
        _json({"step": 1, "total_tokens": INT64, "total_samples": 1}),
        422,
        "validation_error",
        "body.total_tokens",
    ),
    (
        "checkpoint-total-samples-2^63",
        "POST",
        "/v1/pool/runs/{run}/checkpoints",
        WORKER_JSON,
        _json({"step": 1, "total_samples": INT64}),
        422,
        "validation_error",
        "body.total_samples",
    ),
]
ALL_CASES = CASES + HOSTILE_CASES


def _snapshot(settings) -> tuple:
    counts = row_counts(settings, Tenant, ApiKey, Run, Event, Batch)
    files = sorted(str(p.relative_to(settings.data_dir.parent)) for p in settings.data_dir.parent.rglob("*"))
    return counts, files


def _assert_uniform(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("method", "url", "headers", "body", "status", "code", "field"),
    [c[1:] for c in ALL_CASES],
    ids=[c[0] for c in ALL_CASES],
)
def test_bad_input(client, settings, method, url, headers, body, status, code, field):
    tenant = new_tenant(client)
    run = create_run(client, tenant)
    before = _snapshot(settings)
    r = client.request(
        method, url.replace("{run}", run["id"]), content=body, headers={**tenant.headers, **headers}
    )
    error = _assert_uniform(r, status, code)
    if field is not None:
        reported = [".".join(d["loc"]) for d in error["details"]]
        assert any(loc == field or loc.startswith(field + ".") for loc in reported), reported
    assert _snapshot(settings) == before
    assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["status"] == "active"


def test_every_problem_is_listed(client, tenant):
    body = {"name": "", "config": {"lora": {"rank": 0, "dropout": 1.5}, "batch_size": 0, "extra": True}}
    error = _assert_uniform(
        client.post("/v1/runs", json=body, headers=tenant.headers), 422, "validation_error"
    )
    reported = {".".join(d["loc"]) for d in error["details"]}
    assert reported == {
        "body.name",
        "body.config.lora.rank",
        "body.config.lora.dropout",
        "body.config.batch_size",
        "body.config.extra",
    }
    assert error["message"] == "5 invalid field(s)"


def test_admin_malformed_json(client, settings):
    before = _snapshot(settings)
    r = client.post("/v1/tenants", content=b"{oops", headers={**ADMIN_HEADERS, **JSON})
    _assert_uniform(r, 422, "validation_error")
    assert _snapshot(settings) == before


def test_oversized_body(settings):
    small = settings.model_copy(update={"max_body_bytes": 2048})
    with TestClient(create_app(small)) as client:
        tenant = new_tenant(client)
        before = _snapshot(settings)
        big = b'{"name": "x", "config": {"metadata": {"blob": "' + b"a" * 4096 + b'"}}}'
        _assert_uniform(
            client.post("/v1/runs", content=big, headers={**tenant.headers, **JSON}), 413, "payload_too_large"
        )

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield big[:1000]
            yield big[1000:]

        r = client.post("/v1/runs", content=chunks(), headers={**tenant.headers, **JSON})
        _assert_uniform(r, 413, "payload_too_large")
        assert _snapshot(settings) == before
