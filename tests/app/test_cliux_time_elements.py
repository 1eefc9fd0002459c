"""The dashboard's <time datetime> values: ISO 8601 in UTC with its `Z`, the very string the API
writes for the same time (SQLite hands stored times back naive: they showed no offset at all)."""

import re
from datetime import UTC, datetime, timedelta, timezone

from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.timestamps import as_utc as utc
from app.ui.views import iso_utc
from tests.app.api import TenantHandle, create_run, register
from tests.common import ADMIN_KEY


def _datetimes(page: str) -> list[str]:
    return re.findall(r'<time datetime="([^"]*)"', page)


def _sign_in(client: TestClient, key: str) -> None:
    assert client.post("/ui/login", data={"key": key}, follow_redirects=False).status_code == 303


def test_the_runs_page_times_a_run_as_the_api_does(app: FastAPI, tenant: TenantHandle) -> None:
    with TestClient(app) as client:
        run = create_run(client, tenant)
        _sign_in(client, tenant.key)
        page = client.get("/ui/runs")
    assert page.status_code == 200
    assert run["created_at"].endswith("Z")
    assert _datetimes(page.text) == [run["created_at"]]


def test_the_run_page_times_its_events_as_the_api_does(app: FastAPI, tenant: TenantHandle) -> None:
    with TestClient(app) as client:
        run = create_run(client, tenant)
        client.post(f"/v1/runs/{run['id']}/evict", json={"reason": "x"}, headers=tenant.headers)
        events = client.get(f"/v1/runs/{run['id']}/events", headers=tenant.headers).json()["items"]
        _sign_in(client, tenant.key)
        page = client.get(f"/ui/runs/{run['id']}")
    assert page.status_code == 200
    assert len(events) >= 2
    assert _datetimes(page.text) == [event["at"] for event in events]


def test_the_pools_page_times_a_heartbeat_as_the_api_does(app: FastAPI) -> None:
    with TestClient(app) as client:
        pool_id = register(client)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        pools = client.get("/v1/admin/pools", headers=admin).json()["items"]
        _sign_in(client, ADMIN_KEY)
        page = client.get("/ui/pools")
    assert page.status_code == 200
    heartbeat = next(p["last_heartbeat_at"] for p in pools if p["id"] == pool_id)
    assert heartbeat.endswith("Z")
    assert _datetimes(page.text) == [heartbeat]


def test_a_time_in_another_zone_or_naive_is_written_in_utc() -> None:
    # A Postgres session in another time zone hands times back in it; SQLite hands them back naive.
    in_berlin = datetime(2026, 11, 29, 23, 30, 5, 120000, tzinfo=timezone(timedelta(hours=1)))
    naive = datetime(2026, 11, 29, 22, 30, 5)
    assert iso_utc(in_berlin) == "2026-11-29T22:30:05.120000Z"
    assert iso_utc(naive) == "2026-11-29T22:30:05Z"
    assert utc(in_berlin) == datetime(2026, 11, 29, 22, 30, 5, 120000, tzinfo=UTC)
    assert utc(in_berlin).strftime("%H:%M:%S") == "22:30:05"  # what the page shows beside it
