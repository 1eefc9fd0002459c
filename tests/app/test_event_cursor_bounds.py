"""Event cursors and the dashboard's adapter step out of the columns' range (the hostile-tenant probe,
findings 9 and 10): a 422 on both databases, before any statement is bound (SQLite raised
OverflowError, a 500) and before a live stream's 200 (it broke mid-stream with a traceback, and an
EventSource reconnected every 2 s with the same id)."""

import base64
import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.events.feed import MAX_EVENT_ID, MAX_TXID, FeedPosition
from tests.app.api import LiveServer, TenantHandle, create_run
from tests.app.test_ui import sign_in

BIG = 99999999999999999999
OUT_OF_RANGE = [[BIG, 1], [1, BIG], [2**63, 0], [0, 2**63], [0, 2**31], [-1, 0], [0, -1]]


def cursor_of(position: list[int]) -> str:
    raw = json.dumps(position, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _assert_invalid(r: Any, loc: list[str]) -> None:
    assert r.status_code == 422, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    assert [d["loc"] for d in error["details"]] == [loc]


@pytest.mark.parametrize("position", OUT_OF_RANGE)
def test_an_out_of_range_cursor_is_a_422_on_every_database(
    client: TestClient, tenant: TenantHandle, position: list[int]
) -> None:
    run = create_run(client, tenant)
    url = f"/v1/runs/{run['id']}/events"
    bad = cursor_of(position)
    _assert_invalid(client.get(url, params={"cursor": bad}, headers=tenant.headers), ["query", "cursor"])
    resumed = tenant.headers | {"Last-Event-ID": bad}
    _assert_invalid(client.get(url, headers=resumed), ["header", "Last-Event-ID"])


def test_the_largest_position_is_still_a_cursor(client: TestClient, tenant: TenantHandle) -> None:
    """The bound is the columns' own: the last position they can hold reads as an empty page."""
    run = create_run(client, tenant)
    last = FeedPosition(MAX_TXID, MAX_EVENT_ID).encode()
    assert last == cursor_of([2**63 - 1, 2**31 - 1])  # a BIGINT and a (Postgres) INTEGER
    r = client.get(f"/v1/runs/{run['id']}/events", params={"cursor": last}, headers=tenant.headers)
    assert r.status_code == 200, r.text
    assert r.json() == {"items": [], "next_cursor": last, "has_more": False}


def test_the_dashboard_adapter_step_is_bounded(
    app: FastAPI, client: TestClient, tenant: TenantHandle
) -> None:
    run = create_run(client, tenant)
    ui = TestClient(app)
    sign_in(ui, tenant.key)
    # The API's download bounds (app/adapters/router.py StepPath): `latest` or at most 9 digits.
    for step in (str(BIG), str(2**63), "1000000000", "-1", "1e3", "latest!"):
        r = ui.get(f"/ui/runs/{run['id']}/adapters/{step}")
        assert r.status_code == 422, (step, r.status_code, r.text[:300])
        assert r.json()["error"]["details"][0]["loc"] == ["path", "step"]
    for step in ("999999999", "latest"):
        r = ui.get(f"/ui/runs/{run['id']}/adapters/{step}")
        assert r.json()["error"]["code"] == "adapter_not_found", (step, r.text[:300])


def _stream_status(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
    """The status a stream request gets, and a refusal's body (an open stream is hung up on at once)."""
    with httpx.Client(timeout=10) as c, c.stream("GET", url, headers=headers) as r:
        if r.status_code == 200:
            return 200, None
        body: dict[str, Any] = json.loads(r.read())
        return r.status_code, body


def test_a_live_stream_checks_its_cursor_and_last_event_id_before_its_200(
    app: FastAPI, tenant: TenantHandle, client: TestClient
) -> None:
    run = create_run(client, tenant)
    good = client.get(f"/v1/runs/{run['id']}/events", headers=tenant.headers).json()["next_cursor"]
    bad = cursor_of([BIG, 1])
    sse = {"Accept": "text/event-stream"}
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=10) as http:
        assert http.post("/ui/login", data={"key": tenant.key}).status_code == 303  # the cookie in its jar
        cookie = {"Cookie": "; ".join(f"{k}={v}" for k, v in http.cookies.items())}
        for url, auth in (
            (f"{live.url}/v1/runs/{run['id']}/events", tenant.headers),
            (f"{live.url}/ui/runs/{run['id']}/events", cookie),
        ):
            cases = [
                ({"cursor": bad}, {}, ["query", "cursor"]),
                ({}, {"Last-Event-ID": bad}, ["header", "Last-Event-ID"]),
                # Each is checked when given, also when the other one is the one used.
                ({"cursor": good}, {"Last-Event-ID": bad}, ["header", "Last-Event-ID"]),
                ({"cursor": bad}, {"Last-Event-ID": good}, ["query", "cursor"]),
            ]
            for params, headers, loc in cases:
                target = str(httpx.URL(url, params=params))
                status, body = _stream_status(target, auth | sse | headers)
                assert status == 422, (url, params, headers, status)
                assert body is not None and [d["loc"] for d in body["error"]["details"]] == [loc]
            # A good one still streams.
            assert _stream_status(str(httpx.URL(url, params={"cursor": good})), auth | sse)[0] == 200
            assert _stream_status(url, auth | sse | {"Last-Event-ID": good})[0] == 200
