"""A TOML run body is held to bounds on its text before tomllib parses it (app/runs/toml_bounds.py).

tomllib takes time quadratic in the dotted parts of a key or table header: the probe's 64 KiB body,
one key of 32,700 parts, took 51.7 s of CPU inside the route, its database session open (SQLite: the
write lock), and 16 of them stalled every other tenant. Each hostile form is now a 422 that names the
bound, and tomllib is never called for it (checked by making tomllib fail the test, not by timing).
The route also ends the key lookup's transaction before it parses. Nothing is stored. Both databases.
"""

import sys
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.key_cache import ApiKeyCache
from app.runs import router, schemas
from app.runs.schemas import MAX_CREATE_BODY_VALUES
from app.runs.toml_bounds import MAX_KEY_CHECK_PARTS, MAX_KEY_PARTS, toml_text_excess
from tests.app.api import TenantHandle
from tests.common import FakeClock

TOML = {"Content-Type": "application/toml"}


@pytest.fixture
def no_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(text: str) -> Any:
        raise AssertionError("tomllib parsed a body its text bounds refuse")

    monkeypatch.setattr(tomllib, "loads", never)


def _post(client: TestClient, tenant: TenantHandle, body: str) -> Any:
    assert len(body.encode()) <= schemas.MAX_TOML_BODY_BYTES
    return client.post("/v1/runs", content=body.encode(), headers=tenant.headers | TOML)


def _refused(r: Any, kind: str, limit: int, actual: int) -> str:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    [detail] = error["details"]
    assert detail["loc"] == ["body"]
    assert (detail["type"], detail["limit"], detail["actual"]) == (kind, limit, actual), detail
    assert detail["msg"] in error["message"]
    message: str = error["message"]
    return message


def _runs(client: TestClient, tenant: TenantHandle) -> int:
    return len(client.get("/v1/runs", headers=tenant.headers).json()["items"])


LONG = 32700
"""The probe's key: 65,431 bytes, under the 64 KiB TOML cap."""

LONG_KEYS = {
    "dotted key (the probe's)": ('name = "d"\n[config.metadata]\n' + "a" + ".a" * LONG + "=1\n", LONG + 1),
    "table header": ('name = "d"\n[config.metadata.a' + ".a" * (LONG - 3) + "]\n", LONG),
    "array-of-tables header": ('name = "d"\n[[a' + ".a" * (LONG - 1) + "]]\n", LONG),
    "inline table's key": ('name = "d"\nx = {a' + ".a" * (LONG - 1) + " = 1}\n", LONG),
    "quoted parts": ('name = "d"\n"a"' + '."a"' * 16000 + " = 1\n", 16001),
    "literal parts, spaced": ("name = 'd'\n'a'" + " . 'a'" * 10000 + " = 1\n", 10001),
}


@pytest.mark.parametrize("case", sorted(LONG_KEYS))
def test_a_key_of_too_many_parts_is_refused_unparsed(client, tenant, no_parse, case: str) -> None:
    body, parts = LONG_KEYS[case]
    message = _refused(_post(client, tenant, body), "too_deep", MAX_KEY_PARTS, parts)
    assert "nested too deeply" in message and f"{parts} dotted parts" in message
    assert _runs(client, tenant) == 0


def test_the_key_parts_bound_is_counted_exactly() -> None:
    def key(parts: int) -> str:
        return 'x = "a.b.c"  # .d.e\n' + ".".join(["k"] * parts) + " = 1\n"

    assert toml_text_excess(key(MAX_KEY_PARTS), max_values=10) is None
    excess = toml_text_excess(key(MAX_KEY_PARTS + 1), max_values=10)
    assert excess is not None and (excess.bound, excess.measured) == ("key_parts", MAX_KEY_PARTS + 1)


KEY_CHECKS = {
    # tomllib walks the table header once per part of each key under it.
    "a 64-part header over 1,100 one-part keys": (
        "[" + ".".join(["h"] * MAX_KEY_PARTS) + "]\n" + "".join(f"k{i} = 1\n" for i in range(1100)),
        1101 * (64 + 1),  # `name = "d"` too
    ),
    "300 keys of 16 parts": (
        "".join(f"{'.'.join(['a'] * 15)}.k{i} = 1\n" for i in range(300)),
        300 * 16 * 16 + 1,  # `name = "d"` too
    ),
}


@pytest.mark.parametrize("case", sorted(KEY_CHECKS))
def test_keys_too_long_in_all_are_refused_unparsed(client, tenant, no_parse, case: str) -> None:
    keys, checked = KEY_CHECKS[case]
    message = _refused(
        _post(client, tenant, 'name = "d"\n' + keys), "keys_too_long", MAX_KEY_CHECK_PARTS, checked
    )
    assert "keys too long" in message
    assert _runs(client, tenant) == 0


def test_a_body_as_the_cli_writes_it_is_within_the_key_bounds() -> None:
    """tomli_w's form at the run body's limits: 1,000 metadata values under 8-level-deep headers."""
    header = "[config.metadata." + ".".join(["m"] * 7) + "]\n"
    body = 'name = "d"\n' + header + "".join(f"k{i} = {i}\n" for i in range(1999))
    assert toml_text_excess(body, max_values=MAX_CREATE_BODY_VALUES) is None
    dotted = "".join(f"config.metadata.k{i} = {i}\n" for i in range(1999))
    assert toml_text_excess('name = "d"\n' + dotted, max_values=MAX_CREATE_BODY_VALUES) is None


@pytest.mark.parametrize(
    "values",
    [
        "x = [" + "1," * 20000 + "]\n",
        "".join(f"k{i} = 1\n" for i in range(2500)),
        "".join(f"[t{i}]\n" for i in range(2500)),
    ],
    ids=["commas", "pairs", "headers"],
)
def test_more_values_than_a_body_holds_are_refused_unparsed(client, tenant, no_parse, values: str) -> None:
    r = _post(client, tenant, 'name = "d"\n[config.metadata]\n' + values)
    assert r.status_code == 422, r.text
    [detail] = r.json()["error"]["details"]
    assert (detail["loc"], detail["type"], detail["limit"]) == (
        ["body"],
        "too_many_values",
        MAX_CREATE_BODY_VALUES,
    )
    assert detail["actual"] > MAX_CREATE_BODY_VALUES
    assert _runs(client, tenant) == 0


def test_nesting_behind_a_literal_string_with_a_quote_is_a_422(client, tenant) -> None:
    """The JSON byte scan took `'"'` for the start of a string and missed the brackets after it:
    tomllib recursed until a RecursionError (a 500)."""
    r = _post(client, tenant, "name = '\"'\nx = " + "[" * 3000 + "]" * 3000 + "\n")
    assert r.status_code == 422, r.text
    assert r.json()["error"]["message"] == "malformed TOML body: nested too deeply"
    assert _runs(client, tenant) == 0


def test_strings_and_comments_count_for_none_of_the_bounds(client, tenant) -> None:
    """Dots, brackets, `=` and commas inside strings and comments are text: a run with them is made
    (the JSON byte scan refused 40 brackets in a literal string as nesting)."""
    dotted = ".".join(["a"] * 500)
    body = (
        'name = "ok"  # ' + "=," * 2500 + "\n"
        "[config.metadata]\n"
        f'basic = "{dotted}"\n'
        f"literal = '{'[' * 40}'\n"
        f'"quoted.{dotted}" = 1\n'
        f'multi = """\n{dotted}\n[{dotted}]\n"""\n'
    )
    r = _post(client, tenant, body)
    assert r.status_code == 201, r.text
    assert r.json()["config"]["metadata"]["basic"] == dotted


def test_an_unterminated_string_ends_the_scan_where_tomllib_stops(client, tenant) -> None:
    r = _post(client, tenant, 'name = "x\n' + "a" + ".a" * 100 + " = 1\n")
    assert r.status_code == 422, r.text
    assert "malformed TOML body" in r.json()["error"]["message"]


@pytest.fixture
def key_cache_missed(app: FastAPI) -> None:
    """An empty key cache: the request's key is looked up in the database, in its session."""
    app.state.api_key_cache = ApiKeyCache(60.0, clock=FakeClock())


@pytest.fixture
def session_at_parse(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether the route's session was in a transaction when the body was parsed, per request."""
    seen: list[bool] = []
    real = schemas.parse_run_create

    def parse(body: bytes, content_type: str | None) -> Any:
        session = sys._getframe(1).f_locals["session"]  # the route's own (its caller's) session
        seen.append(session.in_transaction())
        return real(body, content_type)

    monkeypatch.setattr(router, "parse_run_create", parse)
    yield seen


def test_the_body_is_parsed_with_no_transaction_open(
    client, tenant, key_cache_missed, session_at_parse
) -> None:
    """The key lookup's transaction (SQLite: the write lock, BEGIN IMMEDIATE) was held through the
    parse: 16 slow bodies made another tenant's requests wait 10 s, then 503 "database is locked"."""
    r = _post(client, tenant, 'name = "d"\n[config.metadata]\n' + "a" + ".a" * 100 + " = 1\n")
    assert r.status_code == 422, r.text
    r = _post(client, tenant, 'name = "made"\n[config]\nmax_steps = 3\n')
    assert r.status_code == 201, r.text
    assert session_at_parse == [False, False]
    assert _runs(client, tenant) == 1


def test_a_too_long_integer_is_located_in_one_parse(client, tenant, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsed as it was first, up to int()'s ValueError, then again with the number marked: twice
    the (bounded) parse time for the body that costs most."""
    parsed: list[str] = []
    real = tomllib.loads

    def counted(text: str) -> Any:
        parsed.append(text)
        return real(text)

    monkeypatch.setattr(tomllib, "loads", counted)
    r = _post(client, tenant, 'name = "d"\n[config]\nseed = ' + "1_" * 5000 + "1\n")
    assert r.status_code == 422, r.text
    assert [d["loc"] for d in r.json()["error"]["details"]] == [["body", "config", "seed"]]
    assert len(parsed) == 1
    assert _runs(client, tenant) == 0
