"""A number with more digits than Python converts (4300, sys.get_int_max_str_digits()) in a JSON or
TOML body is a 422 that names its field and says the number is too long.

json.loads and tomllib convert every integer with int(), whose error speaks of Python's internals:
a run create answered `malformed JSON body: Exceeds the limit (4300 digits) for integer string
conversion ...; use sys.set_int_max_str_digits() to increase the limit`, and every route with a typed
JSON body (tenants, the pool's, the Tinker API's) a bare 400 "There was an error parsing the body".
The request guard (app/request_guard.py) now finds such a number in any JSON body, and the runs
route in a TOML one. Nothing is stored. Both databases."""

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, TenantHandle, create_run, register

LONG = "9" * 5000
JSON = {"Content-Type": "application/json"}
TOML = {"Content-Type": "application/toml"}


def _too_long(r: Any, loc: list[str], digits: int = 5000) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error", error
    assert error["details"] == [
        {
            "loc": loc,
            "msg": f"number too long: {digits} digits (at most 4300)",
            "type": "integer_too_long",
            "limit": 4300,
            "actual": digits,
        }
    ], error
    assert error["message"] == f"{'.'.join(loc)}: number too long: {digits} digits (at most 4300)"
    assert "set_int_max_str_digits" not in r.text and "Exceeds the limit" not in r.text


def _runs(client: TestClient, tenant: TenantHandle) -> int:
    r = client.get("/v1/runs", headers=tenant.headers)
    assert r.status_code == 200, r.text
    return len(r.json()["items"])


JSON_RUNS = [
    ('{"name": "a", "config": {"max_steps": %s}}', ["body", "config", "max_steps"]),
    ('{"name": "a", "config": {"max_steps": -%s}}', ["body", "config", "max_steps"]),
    ('{"name": "a", "config": {"metadata": {"k": [1, "x", %s]}}}', ["body", "config", "metadata", "k", "2"]),
    ('{"name": %s}', ["body", "name"]),
    ('{"name": "a", "config": {}, "extra": %s}', ["body", "extra"]),
    ('{"name": "a", "max_steps": %s, "name": "b"}', ["body", "max_steps"]),
    # A key given twice keeps its later value; the body still held the number: named as the body.
    ('{"name": "a", "config": {"max_steps": %s, "max_steps": 3}}', ["body"]),
    # Malformed after the number: the number is still what is wrong first.
    ('{"name": "a", "config": {"max_steps": %s,, }', ["body"]),
]


@pytest.mark.parametrize(("template", "loc"), JSON_RUNS)
def test_a_run_create_names_the_field_of_a_too_long_json_number(
    client: TestClient, tenant: TenantHandle, template: str, loc: list[str]
) -> None:
    r = client.post("/v1/runs", content=template.replace("%s", LONG), headers=tenant.headers | JSON)
    _too_long(r, loc)
    assert _runs(client, tenant) == 0


TOML_RUNS = [
    ('name = "a"\n[config]\nmax_steps = %s\n', ["body", "config", "max_steps"]),
    ('name = "a"\n[config]\nmax_steps = +%s\n', ["body", "config", "max_steps"]),
    ('name = "a"\n[config.metadata]\nk = [1, "x", %s]\n', ["body", "config", "metadata", "k", "2"]),
    ('name = "a"\nconfig = { metadata = { k = { v = %s } } }\n', ["body", "config", "metadata", "k", "v"]),
    # A string of as many digits elsewhere cannot be told apart by the search: named as the body.
    ('name = "a"\n[config.metadata]\ns = "%s"\nk = %s\n', ["body"]),
]


@pytest.mark.parametrize(("template", "loc"), TOML_RUNS)
def test_a_run_create_names_the_field_of_a_too_long_toml_number(
    client: TestClient, tenant: TenantHandle, template: str, loc: list[str]
) -> None:
    body = template.replace("%s", LONG)
    r = client.post("/v1/runs", content=body, headers=tenant.headers | TOML)
    _too_long(r, loc)
    assert _runs(client, tenant) == 0


def test_toml_underscores_count_as_python_counts_them(client: TestClient, tenant: TenantHandle) -> None:
    """`1_1_..._1` of 4401 digits: int() counts the digits, not the underscores."""
    body = 'name = "a"\n[config]\nmax_steps = %s\n'.replace("%s", "_".join("1" * 4401))
    r = client.post("/v1/runs", content=body, headers=tenant.headers | TOML)
    _too_long(r, ["body", "config", "max_steps"], digits=4401)


def test_typed_json_routes_name_the_field_too(client: TestClient, tenant: TenantHandle) -> None:
    """Routes whose body FastAPI parses (json.loads, then pydantic) answered a bare 400 "There was an
    error parsing the body"; the request guard answers them first."""
    run = create_run(client, tenant)
    pool_id = register(client)
    cases = [
        (
            "/v1/tenants",
            ADMIN_HEADERS,
            '{"name": "x", "max_concurrent_runs": %s}',
            ["body", "max_concurrent_runs"],
        ),
        (
            f"/v1/pool/runs/{run['id']}/steps",
            WORKER_HEADERS,
            '{"step": %s, "total_tokens": 1, "total_samples": 1}',
            ["body", "step"],
        ),
        (
            "/v1/pool/batches/claim",
            WORKER_HEADERS,
            f'{{"pool_id": "{pool_id}", "max_batches": %s}}',
            ["body", "max_batches"],
        ),
        (f"/v1/runs/{run['id']}/evict", tenant.headers, '{"reason": %s}', ["body", "reason"]),
    ]
    for path, headers, template, loc in cases:
        r = client.post(path, content=template.replace("%s", LONG), headers=headers | JSON)
        _too_long(r, loc)
    shown = client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()
    assert (shown["status"], shown["progress"]["step"]) == ("active", 0)  # nothing stored

    # Not refused: a string of 5000 digits is a string; a number of 4300 digits converts (and its
    # field's own bound answers it).
    run = create_run(client, tenant, name="digits", metadata={"s": LONG})
    assert run["config"]["metadata"] == {"s": LONG}
    body = '{"name": "b", "config": {"max_steps": %s}}' % ("9" * 4300)
    r = client.post("/v1/runs", content=body, headers=tenant.headers | JSON)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["details"][0]["loc"] == ["body", "config", "max_steps"]
    assert r.json()["error"]["details"][0]["type"] != "integer_too_long"
    toml = 'name = "c"\n[config.metadata]\ns = "%s"\n'.replace("%s", LONG)
    r = client.post("/v1/runs", content=toml, headers=tenant.headers | TOML)
    assert r.status_code == 201, r.text


def test_the_parsers_alone() -> None:
    """The shared helpers, and the run route's parser called without the request guard before it."""
    from app.request_guard import has_digit_run, long_integer_in_json
    from app.runs.schemas import long_integer_in_toml, parse_run_create

    assert not has_digit_run(b"[" + b"1," * 10_000 + b"1]", 4300)
    assert has_digit_run(b"x" * (5 << 20) + b"1" * 4301, 4300)  # across a block's end
    assert long_integer_in_json(json.dumps({"s": LONG}).encode()) is None
    assert long_integer_in_json(b'{"a": 1' + b"0" * 5000 + b".5}") is None  # a float converts
    assert long_integer_in_toml(f"s = {'1' * 4300}") is None
    with pytest.raises(Exception) as raised:
        parse_run_create(b'{"name": "a", "config": {"max_steps": %s}}' % LONG.encode(), "application/json")
    assert getattr(raised.value, "details", None) == [
        {
            "loc": ["body", "config", "max_steps"],
            "msg": "number too long: 5000 digits (at most 4300)",
            "type": "integer_too_long",
            "limit": 4300,
            "actual": 5000,
        }
    ]


def test_a_large_anonymous_body_is_not_walked_to_name_the_field(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Naming the field walks every value in Python, before authentication and on the event loop: a
    1 MiB body of half a million numbers and one too long took 1.6-2.3 s. Past 64 KiB the guard names
    the body, from the C parser's error alone; a NUL likewise."""
    from app import request_guard

    walked: list[int] = []
    real = request_guard.first_path

    def counted(*args: Any, **kwargs: Any) -> Any:
        walked.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(request_guard, "first_path", counted)
    monkeypatch.setattr(request_guard, "nul_path", lambda data: walked.append(1))
    large = ("[" + "1," * 40_000 + "7" * 4_301 + "]").encode()
    assert len(large) > 64 << 10
    for path in ("/v1/tenants", "/v1/nonexistent"):  # anonymous, before the 401 and the 404
        r = client.post(path, content=large, headers={"Content-Type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["details"] == [
            {
                "loc": ["body"],
                "msg": "number too long: 4301 digits (at most 4300)",
                "type": "integer_too_long",
                "limit": 4300,
                "actual": 4301,
            }
        ]
    with_nul = json.dumps({"a": [1] * 30_000, "s": "x\u0000y"}).encode()
    assert len(with_nul) > 64 << 10
    r = client.post("/v1/tenants", content=with_nul, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["body"], r.text
    assert walked == []
    small = b'{"name": "t", "max_concurrent_runs": ' + b"9" * 4_400 + b"}"
    r = client.post(
        "/v1/tenants", content=small, headers=ADMIN_HEADERS | {"Content-Type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["error"]["details"][0]["loc"] == ["body", "max_concurrent_runs"]
    assert walked == [1]


def test_a_utf16_body_is_refused_as_not_utf8(client: TestClient, tenant: TenantHandle) -> None:
    """Python's json.loads reads UTF-16 bytes too, which look like ASCII with a NUL between their
    characters: the guard's scans read past a too-long number (a 400 "error parsing the body") or a
    NUL in a tag (a 200). JSON is UTF-8: a NUL byte is refused, naming where."""
    too_long = ('{"max_concurrent_runs": ' + "1" * 5_000 + "}").encode("utf-16-le")
    r = client.patch(
        f"/v1/tenants/{tenant.id}",
        content=too_long,
        headers=ADMIN_HEADERS | {"Content-Type": "application/json"},
    )
    assert r.status_code == 422, r.text
    (detail,) = r.json()["error"]["details"]
    assert (
        detail["loc"] == ["body"] and detail["type"] == "unicode_error" and "NUL byte at 1" in detail["msg"]
    )
    tags = '{"tags": ["a\\u0000"], "sdk_version": "x"}'.encode("utf-16-le")
    r = client.post(
        "/api/v1/create_session",
        content=tags,
        headers={"X-API-Key": tenant.key, "Content-Type": "application/json"},
    )
    assert r.status_code == 422 and r.json()["error"]["details"][0]["type"] == "unicode_error", r.text
