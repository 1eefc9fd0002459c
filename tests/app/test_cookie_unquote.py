"""The Cookie header's values are unquoted in one pass (app/cookie_unquote.py, CVE-2024-7592).

On Python before 3.11.10 / 3.12.6 the standard library's `_unquote` searched the rest of a quoted
value again for each backslash: one keyless request with 15,500 backslashes in a cookie froze the
service for 7 s. The replacement must decode exactly as the original, and the served app must never
run the original's per-escape searches."""

import http.cookies
import random
import re

import pytest
from fastapi.testclient import TestClient

from app.cookie_unquote import STDLIB_UNQUOTE, is_affected, unquote

ALPHABET = ["\\", '"', "0", "1", "3", "4", "7", "8", "a", "\n", " ", ";", "é"]


def test_it_decodes_every_value_as_the_standard_library_does() -> None:
    rng = random.Random(7592)
    values: list[str | None] = [
        '"' + "".join(rng.choices(ALPHABET, k=rng.randint(0, 12))) + '"' for _ in range(5000)
    ]
    values += ["", '"', '""', "plain", '"\\"', '"\\', '"\\012\\"x\\\\"', '"\\400"', '"\\37a"', None]
    for value in values:
        assert unquote(value) == STDLIB_UNQUOTE(value), repr(value)


@pytest.mark.parametrize(
    ("version", "affected"),
    [((3, 11, 7), True), ((3, 11, 10), False), ((3, 12, 5), True), ((3, 12, 6), False), ((3, 13, 0), False)],
)
def test_only_the_quadratic_versions_are_patched(version: tuple[int, int, int], affected: bool) -> None:
    assert is_affected(version) is affected


class _Forbidden:
    def search(self, *args: object) -> re.Match[str] | None:
        raise AssertionError("the standard library's quadratic unquote ran")


def test_a_backslash_bomb_never_reaches_the_quadratic_search(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyless request carrying the bomb gets its 401, and the original's per-escape searches
    (the patterns it calls once per backslash) never run: they would fail this test."""
    monkeypatch.setattr(http.cookies, "_QuotePatt", _Forbidden())
    monkeypatch.setattr(http.cookies, "_OctalPatt", _Forbidden())
    bomb = 'x="' + "\\" * 15_500 + '"; loraloom_session="\\141b"'
    r = client.get("/v1/runs", headers={"Cookie": bomb})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"
    # And a well-formed quoted cookie still reads as before (the dashboard's session is unquoted).
    assert http.cookies._unquote('"\\141b"') == "ab"
