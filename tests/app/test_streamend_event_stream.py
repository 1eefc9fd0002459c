"""A live event stream ends once it has delivered its run's deletion: a deleted run's feed never
grows again. Before, a stream on a run deleted meanwhile polled for up to an hour, holding one of
the tenant's 16 stream places (prober, finding 4), and a reconnect past the deletion (an
EventSource reopens a stream that ends) polled again. Now the stream ends right after `run.deleted`,
with no further poll, and a reconnect past it is a 204 at once (an EventSource stops there), on the
API and the dashboard alike. Real HTTP (uvicorn), both databases."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from app.config import Settings
from app.events import router as events_router
from app.events.deletion import deletion_delivered
from app.events.schemas import EventList
from tests.app.api import LiveServer, TenantHandle, create_run, new_tenant
from tests.app.test_run_events import SseReader

SSE = {"Accept": "text/event-stream"}
BOUND_S = 10.0
"""How long a stream may take to end before the test calls it one that goes on (it ends in a poll)."""


class Reads:
    """Spy on the stream's polls (events_router._read): the actions each read served, in order."""

    def __init__(self, real: Callable[..., EventList | None]) -> None:
        self._real = real
        self._lock = threading.Lock()
        self.served: list[list[str]] = []

    def __call__(self, *args: Any) -> EventList | None:
        page = self._real(*args)
        with self._lock:
            self.served.append([item.action for item in page.items] if page is not None else [])
        return page

    def after_deletion(self) -> int:
        """How many reads began after the one that served `run.deleted`."""
        with self._lock:
            served = list(self.served)
        (at,) = [n for n, actions in enumerate(served) if "run.deleted" in actions]
        return len(served) - at - 1


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    spy = Reads(events_router._read)
    monkeypatch.setattr(events_router, "_read", spy)
    return spy


@pytest.fixture
def quick_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_router, "SSE_RECHECK_SECONDS", 0.05)


def _ended(reader: SseReader) -> bool:
    reader.thread.join(timeout=BOUND_S)
    return not reader.thread.is_alive()


def _delete(http: httpx.Client, tenant: TenantHandle, run_id: str) -> None:
    r = http.delete(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert r.status_code == 200, r.text


def _stream_status(url: str, headers: dict[str, str]) -> int:
    """The status a stream request gets (hung up on at once: a 200 would poll on)."""
    with httpx.Client(timeout=BOUND_S) as c, c.stream("GET", url, headers=headers) as r:
        return r.status_code


def _places_freed(app: FastAPI, tenant: TenantHandle) -> bool:
    """The tenant's stream places, once every stream's response has finished (released just after
    its last byte is sent: waited for, within the bound)."""
    done = threading.Event()
    for _ in range(int(BOUND_S / 0.02)):
        if app.state.event_streams.in_flight(tenant.id) == 0:
            return True
        done.wait(0.02)
    return False


def _dashboard_cookie(http: httpx.Client, tenant: TenantHandle) -> dict[str, str]:
    assert http.post("/ui/login", data={"key": tenant.key}).status_code in (200, 303)
    return {"Cookie": "; ".join(f"{k}={v}" for k, v in http.cookies.items())}


@pytest.mark.parametrize("where", ["api", "dashboard"])
def test_a_live_stream_ends_after_the_deletion_and_the_reconnect_is_a_204(
    app: FastAPI, live_server: LiveServer, http: httpx.Client, reads: Reads, where: str
) -> None:
    tenant = new_tenant(http)
    run = create_run(http, tenant)
    if where == "api":
        url, headers = f"{live_server.url}/v1/runs/{run['id']}/events", tenant.headers | SSE
    else:
        url, headers = f"{live_server.url}/ui/runs/{run['id']}/events", _dashboard_cookie(http, tenant) | SSE
    reader = SseReader(url, headers)
    reader.wait_for("run.created", BOUND_S)

    _delete(http, tenant, run["id"])
    assert _ended(reader), "the deleted run's stream went on polling"
    assert reader.events[-1][2] == "run.deleted"  # delivered, then the end
    assert reads.after_deletion() == 0  # ended at once: no poll after the one that served it
    assert _places_freed(app, tenant)

    # The EventSource's reconnect, with the deletion's id: nothing more to send, a 204 at once.
    before = len(reads.served)
    assert _stream_status(url, headers | {"Last-Event-ID": reader.events[-1][1]}) == 204
    assert len(reads.served) == before  # never polled
    assert _places_freed(app, tenant)
    # Before the deletion, the stream goes on from there and ends after it, as the first one did.
    again = SseReader(url, headers | {"Last-Event-ID": reader.events[0][1]})
    assert _ended(again)
    assert [e[1] for e in again.events] == [e[1] for e in reader.events[1:]]


def test_a_stream_opened_on_a_deleted_run_sends_its_history_then_ends(
    live_server: LiveServer, http: httpx.Client, reads: Reads
) -> None:
    tenant = new_tenant(http)
    run = create_run(http, tenant)
    _delete(http, tenant, run["id"])
    url = f"{live_server.url}/v1/runs/{run['id']}/events"
    reader = SseReader(url, tenant.headers | SSE)
    assert _ended(reader)
    actions = [e[2] for e in reader.events]
    assert actions[0] == "run.created" and actions[-1] == "run.deleted"
    assert reads.after_deletion() == 0
    # The JSON feed still serves the deleted run's events (unchanged).
    page = http.get(f"/v1/runs/{run['id']}/events", headers=tenant.headers)
    assert [e["action"] for e in page.json()["items"]] == actions


def test_a_stream_that_never_gets_the_deletion_ends_at_its_next_recheck(
    live_server: LiveServer, http: httpx.Client, quick_rechecks: None
) -> None:
    """`since` after the deletion: the stream never sees `run.deleted`, yet has nothing to wait for."""
    tenant = new_tenant(http)
    run = create_run(http, tenant)
    url = f"{live_server.url}/v1/runs/{run['id']}/events"
    later = httpx.URL(url, params={"since": "9000-01-01T00:00:00Z"})
    reader = SseReader(str(later), tenant.headers | SSE)
    _delete(http, tenant, run["id"])
    assert _ended(reader), "the stream filtered past the deletion went on polling"
    assert reader.events == []
    assert _stream_status(str(later), tenant.headers | SSE) == 204


@pytest.mark.postgres_only
def test_a_deletion_not_yet_served_is_delivered_before_the_stream_ends(
    settings: Settings, live_server: LiveServer, http: httpx.Client, quick_rechecks: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """On Postgres the run reads `deleted` as soon as the deletion commits, while its event waits
    for every older transaction (app/events/feed.py). A stream rechecking then must not take "the
    run is deleted" for "its deletion was delivered": it waits for the event, sends it, then ends."""
    checked_after_deletion = threading.Event()
    deletion_committed = threading.Event()
    answers: list[bool] = []

    def spy(session: Session, **kwargs: Any) -> bool:
        delivered = deletion_delivered(session, **kwargs)
        if deletion_committed.is_set():
            answers.append(delivered)
            checked_after_deletion.set()
        return delivered

    monkeypatch.setattr(events_router, "deletion_delivered", spy)
    tenant = new_tenant(http)
    run = create_run(http, tenant)
    reader = SseReader(f"{live_server.url}/v1/runs/{run['id']}/events", tenant.headers | SSE)
    reader.wait_for("run.created", BOUND_S)

    engine = create_engine(settings.database_url)
    try:
        with _older_transaction(engine) as release:
            _delete(http, tenant, run["id"])
            deletion_committed.set()
            # A recheck saw the run deleted while its event was held back: the stream goes on.
            assert checked_after_deletion.wait(BOUND_S), "no recheck ran"
            assert answers[0] is False, "the deletion counted as delivered before it was sent"
            assert reader.thread.is_alive(), "the stream ended before delivering the deletion"
            assert "run.deleted" not in [e[2] for e in reader.events]
            release()
        assert _ended(reader)
        assert reader.events[-1][2] == "run.deleted"
    finally:
        engine.dispose()


@contextmanager
def _older_transaction(engine: Engine) -> Iterator[Callable[[], None]]:
    """A transaction of the test database holding an xid, begun before the deletion: the feed serves
    nothing newer until it ends (the `release` it yields, or leaving the block)."""
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_current_xact_id()"))
        yield connection.rollback
