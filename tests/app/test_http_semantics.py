"""HTTP as clients expect it: a 405's `Allow`, HEAD on every GET route (downloads included), a 401's
`WWW-Authenticate`, no redirect for a trailing slash, one shape of 422 `details` on the batch
route, and a NaN in a run config named as such."""

import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from app.runs.models import Run
from tests.app.api import (
    ADMIN_HEADERS,
    MSGPACK,
    WORKER_HEADERS,
    LiveServer,
    TenantHandle,
    batch_body,
    create_run,
    new_tenant,
    post_batch,
)
from tests.app.factories import add_pool, batch_count, row_counts, seed_run
from tests.app.test_adapters import adapter_tar, peft_dir, upload

__all__ = ["peft_dir"]  # the module fixture, shared

JSON = {"Content-Type": "application/json"}


def _uniform(r: Any, code: str) -> None:
    assert r.json()["error"]["code"] == code, r.text
    assert set(r.json()["error"]) == {"code", "message", "details"}


# --------------------------------------------------------------------------- 405 and Allow


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/runs", "GET, HEAD, POST"),  # two routes on one path: both named
        ("DELETE", "/v1/runs/run_0123456789ab/batches", "GET, HEAD, POST"),  # the hot route's path
        ("PATCH", "/v1/runs/run_0123456789ab/heartbeat", "POST"),
        ("POST", "/healthz", "GET, HEAD"),
    ],
)
def test_405_names_every_allowed_method(
    client: TestClient, tenant: TenantHandle, method: str, path: str, allow: str
) -> None:
    r = client.request(method, path, headers=tenant.headers)
    assert r.status_code == 405, r.text
    _uniform(r, "method_not_allowed")
    assert r.headers["allow"] == allow


# --------------------------------------------------------------------------- HEAD


def test_head_answers_as_get_without_a_body(client: TestClient, tenant: TenantHandle) -> None:
    create_run(client, tenant)
    for path in ("/v1/runs", "/healthz", "/openapi.json"):
        got = client.get(path, headers=tenant.headers)
        head = client.head(path, headers=tenant.headers)
        assert (head.status_code, head.content) == (200, b""), path
        assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content))
        assert head.headers["content-type"] == got.headers["content-type"]
    # Errors are the GET's too, without their body.
    r = client.head("/v1/runs")
    assert (r.status_code, r.content, r.headers["www-authenticate"]) == (401, b"", "Bearer")
    r = client.head("/v1/nothing-here", headers=tenant.headers)
    assert (r.status_code, r.content) == (404, b"")
    r = client.head("/v1/runs/run_0123456789ab/heartbeat", headers=tenant.headers)
    assert (r.status_code, r.headers["allow"]) == (405, "POST")


def test_head_is_not_an_operation_of_the_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p, ops in paths.items() if "head" in ops]


def _adapter_url(client: Any, tenant: TenantHandle, peft_dir: Path) -> str:
    run = create_run(client, tenant)
    assert upload(client, run["id"], 1, adapter_tar(peft_dir)).status_code == 201
    return f"/v1/runs/{run['id']}/adapters/1"


def test_head_of_a_download_tells_its_length_and_ranges(
    client: TestClient, tenant: TenantHandle, peft_dir: Path
) -> None:
    url = _adapter_url(client, tenant, peft_dir)
    whole = client.get(url, headers=tenant.headers)
    head = client.head(url, headers=tenant.headers)
    assert (head.status_code, head.content) == (200, b"")
    for name in ("content-length", "etag", "accept-ranges", "content-disposition", "x-adapter-step"):
        assert head.headers[name] == whole.headers[name], name
    # Range is defined for GET only (RFC 9110 §14.2): a HEAD with one tells the whole length.
    ranged = client.head(url, headers=tenant.headers | {"Range": "bytes=0-9"})
    assert (ranged.status_code, ranged.headers["content-length"]) == (200, str(len(whole.content)))
    assert "content-range" not in ranged.headers
    # The GET's range answer is untouched.
    part = client.get(url, headers=tenant.headers | {"Range": "bytes=0-9"})
    assert (part.status_code, part.content) == (206, whole.content[:10])


def test_head_under_a_real_server(app: Any, peft_dir: Path) -> None:
    """uvicorn frames a HEAD response itself: the connection stays usable for the next request."""
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        tenant = new_tenant(http)
        url = _adapter_url(http, tenant, peft_dir)
        size = len(http.get(url, headers=tenant.headers).content)
        for _ in range(3):  # one connection (httpx keeps it alive) for all of them
            head = http.head(url, headers=tenant.headers)
            assert (head.status_code, head.content, head.headers["content-length"]) == (200, b"", str(size))
            assert http.head("/v1/runs", headers=tenant.headers).status_code == 200
            assert len(http.get(url, headers=tenant.headers).content) == size
        # A live event stream answers its headers and ends, giving back the tenant's stream place.
        run_id = url.split("/")[3]
        sse = tenant.headers | {"Accept": "text/event-stream"}
        head = http.head(f"/v1/runs/{run_id}/events", headers=sse)
        assert (head.status_code, head.content) == (200, b"")
        assert head.headers["content-type"].startswith("text/event-stream")
        _stream_place_given_back(app, tenant)


def _stream_place_given_back(app: Any, tenant: TenantHandle) -> None:
    deadline = time.monotonic() + 10
    while app.state.event_streams.in_flight(tenant.id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.event_streams.in_flight(tenant.id) == 0


def test_head_of_an_event_stream_ends(app: Any, client: TestClient, tenant: TenantHandle) -> None:
    run = create_run(client, tenant)
    sse = tenant.headers | {"Accept": "text/event-stream"}
    for _ in range(app.state.settings.tenant_max_event_streams + 1):  # each place is given back
        head = client.head(f"/v1/runs/{run['id']}/events", headers=sse)
        assert (head.status_code, head.content) == (200, b"")
    _stream_place_given_back(app, tenant)


# --------------------------------------------------------------------------- 401 and WWW-Authenticate


@pytest.mark.parametrize(
    ("method", "path", "headers", "challenge"),
    [
        ("GET", "/v1/runs", {}, "Bearer"),
        ("GET", "/v1/runs", {"Authorization": "Basic eDp5"}, "Bearer"),
        ("GET", "/v1/runs", {"Authorization": "Bearer llk_nope"}, 'Bearer error="invalid_token"'),
        ("GET", "/v1/tenants", {"Authorization": "Bearer nope"}, 'Bearer error="invalid_token"'),
        ("GET", "/v1/tenants", {}, "Bearer"),
        ("POST", "/v1/pool/heartbeat", {"Authorization": "Bearer nope"}, 'Bearer error="invalid_token"'),
    ],
)
def test_401_names_the_bearer_scheme(
    client: TestClient, method: str, path: str, headers: dict[str, str], challenge: str
) -> None:
    r = client.request(method, path, headers=headers, json={})
    assert r.status_code == 401, r.text
    _uniform(r, "unauthorized")
    assert r.headers["www-authenticate"] == challenge


def test_401_of_a_revoked_key_names_the_bearer_scheme(client: TestClient, tenant: TenantHandle) -> None:
    r = client.delete(f"/v1/tenants/{tenant.id}/keys/{tenant.key_id}", headers=ADMIN_HEADERS)
    assert r.status_code in (200, 204), r.text
    for _ in range(2):  # the lookup, then the miss cache
        r = client.get("/v1/runs", headers=tenant.headers)
        assert (r.status_code, r.headers["www-authenticate"]) == (401, 'Bearer error="invalid_token"')


@pytest.mark.parametrize(
    ("headers", "challenge"),
    [({}, "Bearer"), ({"Authorization": "Bearer llk_nope"}, 'Bearer error="invalid_token"')],
)
def test_401_before_a_bulk_body_names_the_bearer_scheme(
    client: TestClient, tenant: TenantHandle, headers: dict[str, str], challenge: str
) -> None:
    """The request guard answers these before the route (the body unread): the same challenge."""
    run = create_run(client, tenant)
    body = b"[" + b"1," * (40 << 10) + b"1]"  # over the guard's 64 KiB: the key is looked up first
    for path in (f"/v1/runs/{run['id']}/batches", "/v1/adapters"):
        for _ in range(2):  # the lookup, then the miss cache
            r = client.post(path, content=body, headers=headers | JSON)
            assert (r.status_code, r.headers.get("www-authenticate")) == (401, challenge), r.text
            _uniform(r, "unauthorized")


def test_the_dashboard_root_takes_a_trailing_slash(client: TestClient) -> None:
    r = client.get("/ui/", follow_redirects=False)
    assert r.status_code in (303, 307) and r.headers["location"].startswith("/ui"), r.text


def test_other_errors_carry_no_challenge(client: TestClient) -> None:
    r = client.get("/v1/tenants", headers=WORKER_HEADERS)  # a valid credential of another role
    assert r.status_code == 403 and "www-authenticate" not in r.headers


# --------------------------------------------------------------------------- trailing slashes


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/runs/?limit=1"), ("POST", "/v1/runs/"), ("GET", "/healthz/"), ("GET", "/ui/runs/")],
)
def test_trailing_slash_is_a_404_not_a_redirect(
    client: TestClient, tenant: TenantHandle, method: str, path: str
) -> None:
    r = client.request(
        method, path, headers=tenant.headers | {"Host": "evil.example"}, json={}, follow_redirects=False
    )
    assert r.status_code == 404, r.text
    _uniform(r, "not_found")
    assert "location" not in r.headers


# --------------------------------------------------------------------------- the batch route's 422s


def _post_raw(client: TestClient, run_id: str, headers: dict[str, str], body: bytes, ctype: str) -> Any:
    return client.post(f"/v1/runs/{run_id}/batches", content=body, headers=headers | {"Content-Type": ctype})


def _bad_bodies() -> list[tuple[str, bytes, str, dict[str, str]]]:
    """(case, body, content type, extra headers): every kind of check the batch route makes."""
    negative = batch_body(2)
    negative["examples"][0]["prompt_ids"] = [-1, 2]
    negative["examples"][0]["prompt_mask"] = [False, False]
    nul_metric = batch_body(1)
    nul_metric["examples"][0]["metrics"] = {"a\u0000": 1}
    binary_bad = batch_body(1)
    binary_bad["temperature"] = -1.0
    return [
        ("token-id", msgspec.json.encode(negative), "application/json", {}),
        ("nul-in-a-metric-name", msgspec.json.encode(nul_metric), "application/json", {}),
        ("env-not-utf8", b'{"examples": [], "env": "\xff"}', "application/json", {}),
        ("malformed-json", b'{"examples": [', "application/json", {}),
        ("nan-literal", b'{"examples": [], "temperature": NaN}', "application/json", {}),
        ("empty", b"", "application/json", {}),
        ("msgpack", msgspec.msgpack.encode(binary_bad), MSGPACK, {}),
        (
            "idempotency-key-too-long",
            msgspec.json.encode(batch_body(1)),
            "application/json",
            {"Idempotency-Key": "k" * 200},
        ),
    ]


@pytest.mark.parametrize("case", _bad_bodies(), ids=lambda c: c[0])
def test_batch_422_details_are_loc_msg_type(
    settings: Settings, client: TestClient, case: tuple[str, bytes, str, dict[str, str]]
) -> None:
    """Every item of every 422 the batch route answers has `{loc, msg, type}`, whichever check made it
    (the request guard, FastAPI's parameters, the batch's own rules)."""
    add_pool(settings, vocab_size=100)
    seeded = seed_run(settings)
    _, body, ctype, extra = case
    r = _post_raw(client, seeded.run_id, seeded.headers | extra, body, ctype)
    assert r.status_code == 422, r.text
    _uniform(r, "validation_error")
    details = r.json()["error"]["details"]
    assert details
    for item in details:
        assert isinstance(item["loc"], list) and all(isinstance(p, str) for p in item["loc"]), item
        assert item["loc"][0] in ("body", "header"), item
        assert isinstance(item["msg"], str) and item["msg"], item
        assert isinstance(item["type"], str) and item["type"], item
    assert batch_count(settings) == 0


def test_batch_problems_keep_sample_field_problem(settings: Settings, client: TestClient) -> None:
    seeded = seed_run(settings)
    body = batch_body(2, temperature=0.0)
    body["examples"][1]["prompt_ids"] = [-1, 2, 3, 4]
    details = post_batch(client, seeded, body).json()["error"]["details"]
    assert details == [
        {
            "loc": ["body", "temperature"],
            "msg": details[0]["problem"],
            "type": "value_error",
            "sample": None,
            "field": "temperature",
            "problem": details[0]["problem"],
        },
        {
            "loc": ["body", "examples", "1", "prompt_ids"],
            "msg": details[1]["problem"],
            "type": "value_error",
            "sample": 1,
            "field": "prompt_ids",
            "problem": details[1]["problem"],
        },
    ]
    assert "-1" in details[1]["msg"]
    empty = _post_raw(client, seeded.run_id, seeded.headers, b"", "application/json").json()["error"]
    assert [(d["loc"], d["sample"], d["field"]) for d in empty["details"]] == [(["body"], None, "body")]


# --------------------------------------------------------------------------- non-finite run configs


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (b'{"name": "x", "config": {"optim": {"lr": NaN}}}', "application/json"),
        (b'{"name": "x", "config": {"optim": {"lr": Infinity}}}', "application/json"),
        (b'{"name": "x", "config": {"optim": {"lr": 1e999}}}', "application/json"),
        (b'name = "x"\n[config.optim]\nlr = nan\n', "application/toml"),
        (b'name = "x"\n[config.optim]\nlr = -inf\n', "application/toml"),
    ],
)
def test_run_config_nan_is_named_not_finite(
    settings: Settings, client: TestClient, tenant: TenantHandle, body: bytes, ctype: str
) -> None:
    r = client.post("/v1/runs", content=body, headers=tenant.headers | {"Content-Type": ctype})
    assert r.status_code == 422, r.text
    _uniform(r, "validation_error")
    assert r.json()["error"]["details"] == [
        {
            "loc": ["body", "config", "optim", "lr"],
            "msg": "Input should be a finite number",
            "type": "finite_number",
        }
    ]
    assert row_counts(settings, Run) == (0,)


def test_run_config_nan_in_a_pair_is_named_too(client: TestClient, tenant: TenantHandle) -> None:
    body = b'{"name": "x", "config": {"optim": {"betas": [0.9, NaN]}}}'
    r = client.post("/v1/runs", content=body, headers=tenant.headers | JSON)
    assert r.status_code == 422, r.text
    [problem] = r.json()["error"]["details"]
    assert (problem["loc"], problem["type"]) == (["body", "config", "optim", "betas", "1"], "finite_number")


def test_head_ends_an_endless_stream_whatever_the_server() -> None:
    """An ASGI 2.4 server (Starlette then watches no `receive` for a disconnect) whose `receive`
    never says the client left: the HEAD of an endless stream still ends once its headers went."""
    import asyncio

    from starlette.responses import StreamingResponse

    from app.http_semantics import HeadAsGet

    async def endless() -> Any:
        while True:
            yield b"data: x\n\n"
            await asyncio.sleep(0.01)

    async def stream_app(scope: Any, receive: Any, send: Any) -> None:
        await StreamingResponse(endless(), media_type="text/event-stream")(scope, receive, send)

    sent: list[dict[str, Any]] = []

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http",
        "method": "HEAD",
        "path": "/events",
        "headers": [],
        "asgi": {"version": "3.0", "spec_version": "2.4"},
    }
    asyncio.run(asyncio.wait_for(HeadAsGet(stream_app)(scope, never, send), timeout=10))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1]["body"] == b""


def test_a_dashboard_405_names_every_allowed_method(client: TestClient) -> None:
    r = client.put("/ui/login", headers={"Accept": "text/html"})
    assert r.status_code == 405 and "text/html" in r.headers["content-type"]
    assert (
        r.headers["allow"] == client.put("/ui/login", headers={"Accept": "application/json"}).headers["allow"]
    )
    assert "POST" in r.headers["allow"] and "GET" in r.headers["allow"]
