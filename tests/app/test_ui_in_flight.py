"""The dashboard's share of a tenant's limits: its pages and form posts count against the tenant's
`tenant_max_in_flight` (the places its API requests take), held until each has answered; its live
streams hold event-stream places instead, so open streams never keep pages from loading; and each
key holds a bounded number of dashboard sessions (the hostile-tenant probe, finding 4: 48 concurrent
/ui/runs of one tenant all ran, 4 GB of service memory, another tenant's GET took 9.9 s)."""

import threading
from contextlib import ExitStack

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.config import Settings
from app.events.models import Event
from app.limits import InFlight
from app.main import create_app
from app.ui import sessions, views
from app.ui.models import UiSession
from app.ui.sessions import COOKIE
from tests.app.api import ADMIN_HEADERS, LiveServer, Response, TenantHandle, create_run, new_tenant
from tests.app.factories import end_read
from tests.app.test_ui import sign_in
from tests.common import ADMIN_KEY

LIMIT = 2
HTML = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"tenant_max_in_flight": LIMIT})


def in_flight(app: FastAPI) -> InFlight:
    counter: InFlight = app.state.in_flight
    return counter


def _assert_busy(r: Response) -> None:
    assert r.status_code == 429, (r.status_code, r.text[:300])
    assert int(r.headers["retry-after"]) >= 1
    body = r.json()["error"]
    assert body["code"] == "rate_limited"
    assert body["details"] == {"limit": LIMIT, "kind": "requests_in_flight"}


def test_dashboard_requests_count_against_the_tenants_in_flight_places(
    app: FastAPI, client: TestClient, tenant: TenantHandle, other_tenant: TenantHandle
) -> None:
    run = create_run(client, tenant)
    # Browsers of their own (cookie jars) on the app `client` started (one lifespan, one sweeper).
    ui, theirs, admin = TestClient(app), TestClient(app), TestClient(app)
    csrf = sign_in(ui, tenant.key)
    sign_in(theirs, other_tenant.key)
    sign_in(admin, ADMIN_KEY)
    counter = in_flight(app)
    assert counter.in_flight(tenant.id) == 0  # the sign-in's pages gave their places back

    # One place taken (an API request of this tenant in flight): a run page still loads, so its
    # two viewer dependencies (the page's and its run's) take one place, not two.
    counter.acquire(tenant.id)
    assert ui.get(f"/ui/runs/{run['id']}").status_code == 200
    assert counter.in_flight(tenant.id) == 1

    counter.acquire(tenant.id)  # every place taken
    try:
        _assert_busy(ui.get("/ui/runs"))
        _assert_busy(ui.get(f"/ui/runs/{run['id']}"))
        _assert_busy(ui.get(f"/ui/runs/{run['id']}/adapters/1"))
        _assert_busy(ui.get(f"/ui/runs/{run['id']}/events", headers={"Accept": "text/event-stream"}))
        _assert_busy(ui.post(f"/ui/runs/{run['id']}/evict", data={"csrf": csrf, "confirm": "yes"}))
        # A browser's navigation gets a page that says so, with a way back to the page asked for.
        page = ui.get("/ui/runs", params={"name": "a&b"}, headers=HTML)
        assert page.status_code == 429 and int(page.headers["retry-after"]) >= 1
        assert page.headers["content-type"].startswith("text/html")
        assert 'id="busy"' in page.text and f"{LIMIT} requests in progress" in page.text
        assert 'href="/ui/runs?name=a%26b"' in page.text
        assert page.headers["content-security-policy"]  # still a dashboard page
        # Other tenants, and the admin (not counted), are not held back by this tenant.
        assert theirs.get("/ui/runs").status_code == 200
        assert admin.get("/ui/admin").status_code == 200
        assert counter.in_flight(tenant.id) == LIMIT  # refusals took nothing
    finally:
        counter.release(tenant.id)
        counter.release(tenant.id)
    assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["status"] == "active"
    assert ui.get("/ui/runs").status_code == 200
    assert counter.in_flight(tenant.id) == 0


# SQLite takes its write lock at BEGIN: a request held in its handler holds every other request of
# every tenant at the database, so per-tenant fairness is a Postgres property (as in
# tests/app/test_availability.py).
@pytest.mark.postgres_only
def test_a_dashboard_page_holds_its_place_until_it_has_answered(
    app: FastAPI,
    client: TestClient,
    tenant: TenantHandle,
    other_tenant: TenantHandle,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered, release = threading.Event(), threading.Event()
    real = views.runs_of

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(10)
        return real(*args, **kwargs)

    ui, theirs = TestClient(app), TestClient(app)
    sign_in(ui, tenant.key)
    sign_in(theirs, other_tenant.key)
    pages = [TestClient(app, cookies={COOKIE: ui.cookies[COOKIE]}) for _ in range(LIMIT)]
    monkeypatch.setattr(views, "runs_of", held)
    answers: list[int] = []
    threads = [
        threading.Thread(target=lambda c=c: answers.append(c.get("/ui/runs").status_code)) for c in pages
    ]
    try:
        for thread in threads:  # LIMIT pages of this tenant, each held inside its handler
            entered.clear()
            thread.start()
            assert entered.wait(10)
        assert in_flight(app).in_flight(tenant.id) == LIMIT
        _assert_busy(ui.get("/ui/pools"))  # the next page of this tenant
        r = client.get("/v1/runs", headers=tenant.headers)  # and its API: one limit for both
        assert r.status_code == 429 and r.json()["error"]["details"]["kind"] == "requests_in_flight"
        monkeypatch.setattr(views, "runs_of", real)
        assert theirs.get("/ui/runs").status_code == 200  # another tenant's page is not held back
    finally:
        release.set()
        for thread in threads:
            thread.join(10)
    assert answers == [200] * LIMIT
    assert in_flight(app).in_flight(tenant.id) == 0
    assert ui.get("/ui/pools").status_code == 200


def test_open_dashboard_streams_do_not_keep_pages_from_loading(settings: Settings) -> None:
    """A stream holds an event-stream place for its hour, not an in-flight one: a tenant with as
    many streams open as it may have still loads its pages."""
    streams = LIMIT + 1  # more streams than in-flight places
    app = create_app(settings.model_copy(update={"tenant_max_event_streams": streams}))
    with (
        LiveServer(app) as live,
        httpx.Client(base_url=live.url, timeout=30) as http,
        ExitStack() as open_streams,
    ):
        tenant = new_tenant(http)
        run = create_run(http, tenant)
        assert http.post("/ui/login", data={"key": tenant.key}).status_code == 303  # the cookie in its jar
        url = f"/ui/runs/{run['id']}/events"
        sse = {"Accept": "text/event-stream"}
        readers = []  # kept: a reader dropped would close its stream
        for _ in range(streams):
            r = open_streams.enter_context(http.stream("GET", url, headers=sse))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            assert next(readers[-1]).startswith("retry:")  # the stream has started
        assert app.state.event_streams.in_flight(tenant.id) == streams
        assert in_flight(app).in_flight(tenant.id) == 0
        for _ in range(LIMIT + 1):
            assert http.get("/ui/runs").status_code == 200
            assert http.get(f"/ui/runs/{run['id']}").status_code == 200
        with http.stream("GET", url, headers=sse) as refused:  # the streams have their own limit
            assert refused.status_code == 429
            assert refused.headers["retry-after"]


def _sessions_of(db: Session, *, api_key_id: str | None) -> list[UiSession]:
    db.expire_all()
    owner = UiSession.api_key_id == api_key_id if api_key_id else UiSession.is_admin.is_(True)
    found = list(db.scalars(select(UiSession).where(owner)))
    end_read(db)  # on SQLite an open read holds the write lock (tests/app/factories.py)
    return found


def test_each_key_holds_a_bounded_number_of_sessions_and_a_new_sign_in_ends_the_oldest(
    app: FastAPI, client: TestClient, tenant: TenantHandle, db: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sessions.MAX_SESSIONS_PER_KEY == 64
    bound = 3
    monkeypatch.setattr(sessions, "MAX_SESSIONS_PER_KEY", bound)
    r = client.post(f"/v1/tenants/{tenant.id}/keys", headers=ADMIN_HEADERS)
    assert r.status_code == 201
    second_key, second_key_id = r.json()["key"], r.json()["id"]

    def signed_in(key: str) -> str:
        browser = TestClient(app)  # a browser of its own, on the app `client` started
        r = browser.post("/ui/login", data={"key": key}, follow_redirects=False)
        assert r.status_code == 303, r.text
        return browser.cookies[COOKIE]

    other_key_cookie = signed_in(second_key)
    admin_cookie = signed_in(ADMIN_KEY)
    cookies = [signed_in(tenant.key) for _ in range(bound + 2)]
    assert len(_sessions_of(db, api_key_id=tenant.key_id)) == bound

    def page(cookie: str) -> int:
        browser = TestClient(app, cookies={COOKIE: cookie})
        return browser.get("/ui/pools", follow_redirects=False).status_code

    # The oldest two ended (back to the sign-in page); the newest are the user's to keep.
    assert [page(c) for c in cookies] == [303, 303] + [200] * bound
    # Another key of the same tenant, and the admin key, hold their own sessions.
    assert page(other_key_cookie) == 200 and page(admin_cookie) == 200
    assert len(_sessions_of(db, api_key_id=second_key_id)) == 1
    # The audit log says which sign-ins ended sessions.
    signed_in_events = select(Event).where(Event.action == "ui.signed_in", Event.api_key_id == tenant.key_id)
    ended = [e.details.get("sessions_ended") for e in db.scalars(signed_in_events.order_by(Event.id))]
    end_read(db)
    assert ended == [None] * bound + [1, 1]

    admins = [signed_in(ADMIN_KEY) for _ in range(bound)]
    assert len(_sessions_of(db, api_key_id=None)) == bound
    assert page(admin_cookie) == 303 and all(page(c) == 200 for c in admins)
    assert len(_sessions_of(db, api_key_id=tenant.key_id)) == bound  # untouched by the admin's
