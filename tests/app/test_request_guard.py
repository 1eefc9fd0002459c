"""The request guard's body checks (app/request_guard.py) against what a parser sees, and the bodies a
hostile client sent before authentication: a 60 MB string took 19 s of the event loop in the depth
check's regular expression, and a 16 MB body holding one `\\u0000` 2 GB of memory in the NUL check's
parse (every other tenant waited meanwhile). The checks are now linear scans; these tests pin what
they answer, not how fast (docs/benchmarks.md is for speed)."""

import gzip
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app import request_guard
from app.config import Settings
from app.main import create_app
from app.request_guard import MAX_JSON_DEPTH, nested_deeper, too_deep
from tests.app.api import batch_body, create_run, new_tenant

JSON = {"Content-Type": "application/json"}


def _depth(value: Any) -> int:
    """Nesting levels of a parsed value, recursively (the oracle: small values only)."""
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    """Values whose strings hold brackets, quotes and backslashes: what the scan must not count."""
    r = rng.random()
    if depth > 12 or r < 0.3:
        return rng.choice([1, 'a"[b', "x\\", '\\"]]', "{[", None, True, "é]", "\\\\u0000"])
    if r < 0.65:
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "[", '"}', "\\"]) + str(i): _random_value(rng, depth + 1) for i in range(3)}


@pytest.mark.parametrize("block_bytes", [1, 7, 1 << 22], ids=["1-byte blocks", "7-byte blocks", "4 MiB"])
def test_too_deep_agrees_with_the_parsed_depth(monkeypatch: pytest.MonkeyPatch, block_bytes: int) -> None:
    # Small blocks cut strings, escapes' neighbours and bracket runs at every place.
    monkeypatch.setattr(request_guard, "_BLOCK_BYTES", block_bytes)
    rng = random.Random(block_bytes)
    for _ in range(400):
        value = _random_value(rng)
        body = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        for limit in (1, 3, 6):
            assert too_deep(body, limit) == (_depth(value) > limit), body
            assert nested_deeper(value, limit) == (_depth(value) > limit)


def test_too_deep_at_the_limit_and_on_malformed_bodies() -> None:
    at, over = MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1
    assert not too_deep(b"[" * at + b"]" * at)
    assert too_deep(b"[" * over + b"]" * over)
    assert too_deep(b"[" * over)  # unclosed: a parser descends through them before it notices
    # A closing bracket too many ends what a parser reads: nothing after it is descended into.
    assert not too_deep(b"[1]]" + b"[" * 100)
    assert not too_deep(b'"' + b"[" * 100 + b'"')  # brackets in a string are text
    assert too_deep(b'"\\\\"' + b"[" * over)  # an escaped backslash does not escape the quote


def test_hostile_bodies_get_their_answer_without_a_parse() -> None:
    long_string = b'"' + b"a" * 3_000_000 + b'"'
    assert request_guard._json_problem(b"", long_string) is None
    # Over 1 MiB a NUL is reported for the body (naming its field would mean parsing it).
    with_nul = b'{"a": "\\u0000", "b": [' + b"0," * 1_000_000 + b"0]}"
    problem = request_guard._json_problem(b"application/json", with_nul)
    assert problem is not None
    assert problem["error"]["details"] == [
        {"loc": ["body"], "msg": "must not contain a NUL character", "type": "nul_character"}
    ]
    # `\\u0000` is an escaped backslash and the text "u0000": no NUL, however large the body.
    escaped = b'{"a": "\\\\u0000", "b": "' + b"x" * 2_000_000 + b'"}'
    assert request_guard._json_problem(b"application/json", escaped) is None


def test_large_bodies_are_refused_through_the_app(settings) -> None:
    """Over 1 MiB the checks run in a worker thread; their answers are the same uniform 422s."""
    roomy = settings.model_copy(update={"max_small_body_bytes": 4 << 20})  # run configs up to 4 MiB
    with TestClient(create_app(roomy)) as client:
        _refused_in_a_thread(client)


def _refused_in_a_thread(client: TestClient) -> None:
    tenant = new_tenant(client)
    padding = b"x" * (1 << 20)
    deep = b'{"name": "x", "pad": "' + padding + b'", "config": ' + b"[" * 40 + b"]" * 40 + b"}"
    nul = b'{"name": "a\\u0000", "pad": "' + padding + b'"}'
    for body, kind in ((deep, "too_deep"), (nul, "nul_character")):
        r = client.post("/v1/runs", content=body, headers={**tenant.headers, **JSON})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["details"][0]["type"] == kind
        assert client.get("/v1/runs", headers=tenant.headers).json()["items"] == []


def test_routes_without_bulk_data_take_small_bodies_only(client) -> None:
    """An anonymous client could send 64 MB to any route, to be read and scanned before the 401:
    routes that take no bulk data stop at `max_small_body_bytes` (1 MiB), declared or streamed."""
    small = Settings.model_fields["max_small_body_bytes"].default
    big = b'{"name": "' + b"x" * small + b'"}'

    def streamed() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield big[: len(big) // 2]
        yield big[len(big) // 2 :]

    tenant = new_tenant(client)
    for method, path in (
        ("POST", "/v1/runs"),
        ("POST", "/v1/tenants"),
        ("GET", "/v1/runs"),
        ("POST", "/ui/login"),
    ):
        for content in (big, streamed()):
            r = client.request(method, path, content=content, headers=JSON)
            assert r.status_code == 413, (method, path, r.text)
            assert r.json()["error"]["message"] == f"request body exceeds {small} bytes"
    assert client.get("/v1/runs", headers=tenant.headers).json()["items"] == []
    # The bulk routes take it, to their own checks (here: who is asking).
    for path in (
        "/v1/runs/run_x/batches",
        "/v1/adapters",
        "/v1/pool/manual/results",
        "/api/v1/forward_backward",
    ):
        r = client.post(path, content=big, headers=JSON)
        assert r.status_code == 401, (path, r.text)


@pytest.mark.parametrize("header", ["Idempotency-Key", "Authorization", "Content-Type"])
def test_a_header_the_routes_read_once_may_be_sent_once(client, header: str) -> None:
    """Two Idempotency-Keys were stored under the first silently (a retry sending the other one made
    a second batch); two keys or body types could mean another tenant or format than the one used."""
    tenant = new_tenant(client)
    run = create_run(client, tenant)
    values = {
        "Idempotency-Key": ["k1", "k2"],
        "Authorization": [tenant.headers["Authorization"]] * 2,
        "Content-Type": ["application/json", "application/msgpack"],
    }[header]
    headers = [*((k, v) for k, v in {**tenant.headers, **JSON}.items() if k != header)]
    headers += [(header, v) for v in values]
    r = client.post(f"/v1/runs/{run['id']}/batches", content=json.dumps(batch_body()), headers=headers)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["details"] == [
        {"loc": ["header", header.lower()], "msg": "must be sent once", "type": "repeated_header"}
    ]
    assert client.get(f"/v1/runs/{run['id']}/batches", headers=tenant.headers).json()["items"] == []


def test_toml_dotted_headers_nested_too_deeply_are_a_422(client) -> None:
    """`[config.metadata.a.a....]` nests a level per dot, without a bracket the byte scan counts: at 500
    levels the run's digest failed with a 500, at 40 a run was stored deeper than JSON may nest."""
    tenant = new_tenant(client)
    for depth in (40, 500):
        body = 'name = "x"\n[config.metadata.' + ".".join(["a"] * depth) + "]\nb = 1\n"
        r = client.post(
            "/v1/runs", content=body.encode(), headers={**tenant.headers, "Content-Type": "application/toml"}
        )
        assert r.status_code == 422, r.text
        assert "nested too deeply" in r.json()["error"]["message"]
    assert client.get("/v1/runs", headers=tenant.headers).json()["items"] == []


@pytest.mark.parametrize(("encoding", "compress"), [("gzip", True), ("br", False), ("deflate, gzip", False)])
def test_an_encoded_body_is_a_415_and_nothing_is_stored(client, encoding: str, compress: bool) -> None:
    """No route decodes a Content-Encoding: a gzip batch was read as it is (a 422 "not UTF-8"), and a
    plain body labelled gzip was stored."""
    tenant = new_tenant(client)
    run = create_run(client, tenant)
    body = json.dumps(batch_body(2)).encode()
    r = client.post(
        f"/v1/runs/{run['id']}/batches",
        content=gzip.compress(body) if compress else body,
        headers={**tenant.headers, **JSON, "Content-Encoding": encoding},
    )
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_media_type"
    assert encoding.split(",")[0] in r.json()["error"]["message"]
    listed = client.get(f"/v1/runs/{run['id']}/batches", headers=tenant.headers).json()
    assert listed["items"] == []
    plain = client.post(
        f"/v1/runs/{run['id']}/batches",
        content=body,
        headers={**tenant.headers, **JSON, "Content-Encoding": "identity"},
    )
    assert plain.status_code == 201, plain.text
