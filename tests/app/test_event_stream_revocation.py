"""A live event stream ends once its credential no longer holds: an API key revoked, a dashboard
session signed out. Before, a stream opened with a key went on for up to an hour after the key was
revoked (a probe saw `run.evicted` delivered to it after the revoke)."""

import time

import httpx
import pytest

from app.events import router as events_router
from tests.app.api import ADMIN_HEADERS, LiveServer, create_run, new_tenant
from tests.app.test_run_events import SseReader

SSE = {"Accept": "text/event-stream"}


@pytest.fixture(autouse=True)
def quick_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_router, "SSE_RECHECK_SECONDS", 0.1)


def _ends(reader: SseReader, within: float = 10.0) -> bool:
    reader.thread.join(timeout=within)
    return not reader.thread.is_alive()


def test_a_stream_ends_when_its_key_is_revoked_and_others_go_on(
    live_server: LiveServer, http: httpx.Client
) -> None:
    tenant = new_tenant(http)
    second = http.post(f"/v1/tenants/{tenant.id}/keys", headers=ADMIN_HEADERS).json()
    run = create_run(http, tenant)
    url = f"{live_server.url}/v1/runs/{run['id']}/events"
    doomed = SseReader(url, tenant.headers | SSE)
    kept = SseReader(url, {"Authorization": f"Bearer {second['key']}"} | SSE)
    doomed.wait_for("run.admitted", 5)
    kept.wait_for("run.admitted", 5)

    r = http.delete(f"/v1/tenants/{tenant.id}/keys/{tenant.key_id}", headers=ADMIN_HEADERS)
    assert r.status_code == 204
    assert _ends(doomed), "the revoked key's stream went on"
    # The reconnect an EventSource would make is refused (and it does not retry a 401).
    with httpx.Client(timeout=10) as c, c.stream("GET", url, headers=tenant.headers | SSE) as refused:
        assert refused.status_code == 401

    # The other key's stream saw many rechecks pass and still delivers.
    time.sleep(0.5)
    assert kept.thread.is_alive()
    r = http.post(
        f"/v1/runs/{run['id']}/evict",
        json={"reason": "done watching"},
        headers={"Authorization": f"Bearer {second['key']}"},
    )
    assert r.status_code == 200, r.text
    kept.wait_for("run.evicted", 5)
    kept.close()


def test_a_dashboard_stream_ends_when_its_session_signs_out(
    live_server: LiveServer, http: httpx.Client
) -> None:
    tenant = new_tenant(http)
    run = create_run(http, tenant)
    assert http.post("/ui/login", data={"key": tenant.key}).status_code in (200, 303)
    cookie = {"Cookie": "; ".join(f"{k}={v}" for k, v in http.cookies.items())}
    reader = SseReader(f"{live_server.url}/ui/runs/{run['id']}/events", cookie | SSE)
    reader.wait_for("run.admitted", 5)
    time.sleep(0.3)
    assert reader.thread.is_alive()  # signed in: rechecks pass

    # Signing out elsewhere (another tab) ends this session: its stream ends with it.
    page = http.get("/ui/runs")
    csrf = page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
    assert http.post("/ui/logout", data={"csrf": csrf}).status_code in (200, 303)
    assert _ends(reader), "the signed-out session's stream went on"
