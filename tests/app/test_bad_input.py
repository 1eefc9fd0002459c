"""Bad input, table-driven: every case gets a clear 4xx in the uniform error body, and
nothing is stored (row counts and files unchanged)."""

import pytest
from fastapi.testclient import TestClient

from app.events.models import Event
from app.main import create_app
from app.runs.models import Run
from app.tenants.models import ApiKey, Tenant
from tests.app.api import ADMIN_HEADERS, create_run, new_tenant
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


def _snapshot(settings) -> tuple:
    counts = row_counts(settings, Tenant, ApiKey, Run, Event)
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
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
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
