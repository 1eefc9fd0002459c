"""Rewards per rollout step in the run's metrics, and the run's event feed: JSON pages (cursor,
since; every event exactly once, also when transactions commit out of id order) and the live
Server-Sent Events stream under real uvicorn (resumable with Last-Event-ID)."""

import json
import math
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from app.config import Settings
from app.events import router as events_router
from app.events.schemas import EventList
from app.events.service import record_event
from app.main import create_app
from tests.app.api import (
    WORKER_HEADERS,
    Client,
    LiveServer,
    TenantHandle,
    create_run,
    new_tenant,
    post_batch,
    rewarded_batch,
)
from tests.app.factories import Seeded, committed
from tests.common import backend_under_test, create_postgres_database, drop_postgres_database


def run_ref(tenant: TenantHandle, run_id: str) -> Seeded:
    """What post_batch needs: the run and its tenant's key."""
    return Seeded(tenant_id=tenant.id, secret=tenant.key, run_id=run_id)


def report_step(client: Client, run_id: str, step: int, loss: float = 0.5) -> None:
    body = {"step": step, "total_tokens": 10 * step, "total_samples": 4 * step, "metrics": {"loss": loss}}
    r = client.post(f"/v1/pool/runs/{run_id}/steps", json=body, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text


def all_events(
    client: Client, tenant: TenantHandle, run_id: str, limit: int = 200, **params: Any
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    cursor = None
    while True:
        q = {"limit": limit, **params} | ({"cursor": cursor} if cursor else {})
        r = client.get(f"/v1/runs/{run_id}/events", params=q, headers=tenant.headers)
        assert r.status_code == 200, r.text
        page = r.json()
        out += page["items"]
        cursor = page["next_cursor"]
        if not page["has_more"]:
            return out


# --------------------------------------------------------------------------- rewards


def test_rewards_are_aggregated_per_rollout_step(client: TestClient, tenant: TenantHandle) -> None:
    run = create_run(client, tenant, max_steps=10)
    ref = run_ref(tenant, run["id"])
    # Step 0 in two batches (one sample without a reward): rewards 1, 2, 3, 4.
    first = rewarded_batch([1.0, 2.0, None], step=0, metrics=[{"format_ok": 1.0}, {"format_ok": 0.0}, None])
    assert post_batch(client, ref, first).status_code == 201
    assert post_batch(client, ref, rewarded_batch([3.0, 4.0], step=0)).status_code == 201
    assert post_batch(client, ref, rewarded_batch([-1.0, 1.0], step=1)).status_code == 201
    # A retried batch (same key) is counted once.
    for _ in range(2):
        assert post_batch(client, ref, rewarded_batch([10.0], step=2), key="k-2").status_code in (200, 201)
    report_step(client, run["id"], 1, loss=0.75)

    r = client.get(f"/v1/runs/{run['id']}/metrics", headers=tenant.headers)
    assert r.status_code == 200, r.text
    items = {i["step"]: i for i in r.json()["items"]}
    assert sorted(items) == [0, 1, 2]
    # By hand: mean (1+2+3+4)/4 = 2.5; population variance ((1.5² + 0.5²) * 2) / 4 = 1.25.
    assert items[0]["reward"] == {
        "mean": 2.5,
        "std": pytest.approx(math.sqrt(1.25)),
        "min": 1.0,
        "max": 4.0,
        "count": 4,
    }
    assert items[0]["samples_received"] == 5
    assert items[0]["sample_metrics"] == {
        "format_ok": {"mean": 0.5, "std": 0.5, "min": 0.0, "max": 1.0, "count": 2}
    }
    assert items[0]["loss"] is None and items[0]["created_at"] is None  # not a trained step
    assert items[1]["reward"] == {"mean": 0.0, "std": 1.0, "min": -1.0, "max": 1.0, "count": 2}
    assert items[1]["loss"] == 0.75 and items[1]["created_at"]
    assert items[2]["reward"]["count"] == 1 and items[2]["samples_received"] == 1

    # The same, as events: each batch's event carries its step's reward so far.
    received = [e for e in all_events(client, tenant, run["id"]) if e["action"] == "batch.received"]
    assert [e["details"]["rollout_step"] for e in received] == [0, 0, 1, 2]
    assert received[0]["details"]["reward"]["mean"] == 1.5
    assert received[1]["details"]["reward"]["mean"] == 2.5


def test_metrics_since_step_and_paging(client: TestClient, tenant: TenantHandle) -> None:
    run = create_run(client, tenant, max_steps=100)
    ref = run_ref(tenant, run["id"])
    for step in range(0, 7, 2):  # rollouts at 0, 2, 4, 6; trained steps 1..6
        assert post_batch(client, ref, rewarded_batch([float(step)], step=step)).status_code == 201
    for step in range(7, 12):  # samples without rewards: no figure of their own
        assert post_batch(client, ref, rewarded_batch([None], step=step)).status_code == 201
    for step in range(1, 7):
        report_step(client, run["id"], step)
    seen: list[int] = []
    since = 0
    while True:
        r = client.get(
            f"/v1/runs/{run['id']}/metrics", params={"since_step": since, "limit": 2}, headers=tenant.headers
        )
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["items"]) <= 2
        seen += [i["step"] for i in page["items"]]
        if page["next_since_step"] is None:
            break
        since = page["next_since_step"]
    assert seen == [0, 1, 2, 3, 4, 5, 6]
    r = client.get(f"/v1/runs/{run['id']}/metrics", params={"since_step": 5}, headers=tenant.headers)
    assert [i["step"] for i in r.json()["items"]] == [5, 6]
    assert (
        client.get(
            f"/v1/runs/{run['id']}/metrics", params={"since_step": -1}, headers=tenant.headers
        ).status_code
        == 422
    )


# --------------------------------------------------------------------------- the feed


def test_lifecycle_events(client: TestClient) -> None:
    tenant = new_tenant(client, quota=1)
    first = create_run(client, tenant, max_steps=10)
    second = create_run(client, tenant, max_steps=10)  # over the quota: queued
    report_step(client, first["id"], 1)
    r = client.post(
        f"/v1/pool/runs/{first['id']}/checkpoints",
        json={"step": 1, "total_samples": 4},
        headers=WORKER_HEADERS,
    )
    assert r.status_code == 201, r.text
    r = client.post(
        f"/v1/runs/{first['id']}/evict", json={"reason": "reward plateaued"}, headers=tenant.headers
    )
    assert r.status_code == 200, r.text

    events = all_events(client, tenant, first["id"])
    assert [e["action"] for e in events] == [
        "run.created",
        "run.admitted",
        "run.step",
        "checkpoint.committed",
        "run.evicted",
    ]
    step = events[2]
    assert (
        step["actor"] == "trainer"
        and step["details"]["step"] == 1
        and step["details"]["metrics"] == {"loss": 0.5}
    )
    evicted = events[-1]
    assert evicted["actor"] == "tenant"
    assert evicted["details"]["reason"] == "reward plateaued" and evicted["details"]["evicted_by"] == "user"

    queued = all_events(client, tenant, second["id"])
    assert [e["action"] for e in queued] == ["run.created", "run.queued", "run.admitted"]
    assert "quota of 1" in queued[1]["details"]["reason"]
    # Another tenant's run is a 404, as everywhere.
    stranger = new_tenant(client)
    assert client.get(f"/v1/runs/{first['id']}/events", headers=stranger.headers).status_code == 404


def test_paging_returns_every_event_exactly_once(client: TestClient, tenant: TenantHandle) -> None:
    run = create_run(client, tenant, max_steps=1000)
    ref = run_ref(tenant, run["id"])
    for i in range(10):
        assert post_batch(client, ref, rewarded_batch([float(i)], step=0)).status_code == 201
    seen: list[dict[str, Any]] = []
    cursor = None
    step = 0
    for _ in range(100):
        q = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        page = client.get(f"/v1/runs/{run['id']}/events", params=q, headers=tenant.headers).json()
        seen += page["items"]
        cursor = page["next_cursor"]
        if step < 8:  # new events keep arriving while the reader pages
            step += 1
            report_step(client, run["id"], step)
        elif not page["has_more"]:
            break
    ids = [e["id"] for e in seen]
    assert len(ids) == len(set(ids)) == 2 + 10 + 8
    assert ids == [e["id"] for e in all_events(client, tenant, run["id"])]
    # `since`: only events at or after a time; a bad cursor is a 422.
    cut = datetime.fromisoformat(seen[12]["at"])
    later = all_events(client, tenant, run["id"], since=cut.isoformat())
    assert later and all(datetime.fromisoformat(e["at"]) >= cut for e in later)
    assert len(later) < len(seen)
    # Times at datetime's limits are fine as long as they are in range in UTC (an offset that moves
    # one past them is a 422: tests/app/test_bad_input.py, events-since-*).
    assert all_events(client, tenant, run["id"], since="9999-12-31T23:59:59+23:59") == []
    assert len(all_events(client, tenant, run["id"], since="0001-01-01T00:00:00-23:59")) == len(seen)
    r = client.get(f"/v1/runs/{run['id']}/events", params={"cursor": "nope!"}, headers=tenant.headers)
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"


@pytest.mark.postgres_only
def test_an_event_committed_late_is_not_skipped(
    client: TestClient, tenant: TenantHandle, settings: Settings
) -> None:
    """Transaction A takes an event id, then B takes a higher one and commits first. A reader must
    not move past B's event while A's may still appear, nor lose A's event once it commits."""
    if backend_under_test() != "postgres":
        pytest.skip("SQLite serialises writers: ids commit in order there")
    run = create_run(client, tenant, max_steps=10)
    before = all_events(client, tenant, run["id"])
    with committed(settings) as a:
        record_event(
            a, action="run.note", actor="system", tenant_id=tenant.id, run_id=run["id"], details={"n": "A"}
        )
        a.flush()  # A holds the lower id, uncommitted
        report_step(client, run["id"], 1)  # B: a higher id, committed
        page = client.get(
            f"/v1/runs/{run['id']}/events", params={"cursor": before[-1]["cursor"]}, headers=tenant.headers
        ).json()
        assert page["items"] == []  # B waits for A: serving it now could skip A for good
        cursor = page["next_cursor"]
    page = client.get(
        f"/v1/runs/{run['id']}/events", params={"cursor": cursor}, headers=tenant.headers
    ).json()
    assert [e["action"] for e in page["items"]] == ["run.note", "run.step"]


# --------------------------------------------------------------------------- live stream


class SseReader:
    """Reads an SSE stream in a thread; records (time received, id, event, data)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.events: list[tuple[float, str, str, dict[str, Any]]] = []
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.response: httpx.Response
        self.thread = threading.Thread(target=self._run, args=(url, headers), daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "stream did not open"

    def _run(self, url: str, headers: dict[str, str]) -> None:
        with (
            httpx.Client(timeout=httpx.Timeout(30, read=30)) as c,
            c.stream("GET", url, headers=headers) as r,
        ):
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            self.response = r
            self.ready.set()
            fields: dict[str, str] = {}
            try:
                for line in r.iter_lines():
                    if line == "":
                        if "data" in fields:
                            data = json.loads(fields["data"])
                            self.events.append((time.monotonic(), fields["id"], fields["event"], data))
                        fields = {}
                    elif not line.startswith(":"):
                        name, _, value = line.partition(":")
                        fields[name] = value.removeprefix(" ")
            except (httpx.HTTPError, RuntimeError, ValueError):
                if not self.stop.is_set():  # closed by close(): the way a client hangs up
                    raise

    def wait_for(self, action: str, timeout: float) -> tuple[float, str, str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events:
                if ev[2] == action:
                    return ev
            time.sleep(0.02)
        raise AssertionError(f"no {action} event within {timeout} s; got {[e[2] for e in self.events]}")

    def close(self) -> None:
        self.stop.set()
        # Hang up as a browser does: shut the socket (closing the response would not wake a
        # thread blocked reading it).
        sock = self.response.extensions["network_stream"].get_extra_info("socket")
        sock.shutdown(socket.SHUT_RDWR)
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


class StreamReads:
    """Spy on the live stream's polls (events_router._read): what each read, numbered from 1 in the
    order they start, returned. Lets a test say "within two polls" without a real-time limit."""

    def __init__(self, real: Callable[..., EventList | None]) -> None:
        self._real = real
        self._lock = threading.Lock()
        self.started = 0
        self.cursors: dict[int, list[str]] = {}

    def __call__(self, *args: Any) -> EventList | None:
        with self._lock:
            self.started += 1
            number = self.started
        page = self._real(*args)
        self.cursors[number] = [item.cursor for item in page.items] if page is not None else []
        return page

    def read_that_served(self, cursor: str) -> int:
        return next(n for n, cursors in self.cursors.items() if cursor in cursors)


def test_sse_delivers_steps_live_and_resumes(
    live_server: LiveServer, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = StreamReads(events_router._read)
    monkeypatch.setattr(events_router, "_read", reads)
    tenant = new_tenant(http)
    run = create_run(http, tenant, max_steps=100)
    url = f"{live_server.url}/v1/runs/{run['id']}/events"
    sse_headers = tenant.headers | {"Accept": "text/event-stream"}

    reader = SseReader(url, sse_headers)
    reader.wait_for("run.admitted", 5)  # the history comes first
    report_step(http, run["id"], 1)
    reads_before = reads.started  # the step is committed: every read from here on can see it
    _, cursor, _, data = reader.wait_for("run.step", 5)
    # Live: the next poll serves it (or the one after, should an older transaction still have held
    # the Postgres feed's horizon back), not a later one.
    served_in = reads.read_that_served(cursor)
    assert served_in <= reads_before + 2, f"step served by read {served_in}; {reads_before} had started"
    assert data["details"]["step"] == 1
    reader.close()
    seen = [(e[1], e[2]) for e in reader.events]

    # Disconnected: more happens; a reconnect with Last-Event-ID gets exactly what it missed.
    report_step(http, run["id"], 2)
    report_step(http, run["id"], 3)
    resumed = SseReader(url, sse_headers | {"Last-Event-ID": seen[-1][0]})
    resumed.wait_for("run.step", 5)
    deadline = time.monotonic() + 5
    while len([e for e in resumed.events if e[2] == "run.step"]) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    resumed.close()
    missed = [(e[1], e[2], e[3]["details"].get("step")) for e in resumed.events]
    assert [(a, s) for _, a, s in missed] == [("run.step", 2), ("run.step", 3)]
    everything = all_events(http, tenant, run["id"])
    assert [e["cursor"] for e in everything] == [c for c, _ in seen] + [c for c, _, _ in missed]


def test_a_tenant_holds_only_so_many_live_streams(settings: Settings) -> None:
    """A stream stopped counting as a request in flight when its handler returned, then polled the
    feed for an hour: one tenant held 265 of them with an in-flight limit of 16, and every other
    tenant's requests slowed. Streams now count against their own limit for as long as they live."""
    app = create_app(settings.model_copy(update={"tenant_max_event_streams": 2}))
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        tenant, other = new_tenant(http), new_tenant(http)
        run, theirs = create_run(http, tenant), create_run(http, other)
        sse = {"Accept": "text/event-stream"}
        url = f"{live.url}/v1/runs/{run['id']}/events"
        readers = [SseReader(url, tenant.headers | sse) for _ in range(2)]
        assert _stream_answer(url, tenant.headers | sse) == (429, {"limit": 2, "kind": "event_streams"})
        http.post("/ui/login", data={"key": tenant.key})  # the dashboard's stream counts too
        cookie = {"Cookie": "; ".join(f"{k}={v}" for k, v in http.cookies.items())}
        assert _stream_answer(f"{live.url}/ui/runs/{run['id']}/events", cookie | sse)[0] == 429
        SseReader(f"{live.url}/v1/runs/{theirs['id']}/events", other.headers | sse).close()  # unaffected
        readers[0].close()  # hung up: its place is free once the stream notices (within a poll)
        deadline = time.monotonic() + 10
        while _stream_answer(url, tenant.headers | sse)[0] == 429:
            assert time.monotonic() < deadline, "the closed stream's place was never freed"
            time.sleep(0.2)
        readers[1].close()


def _stream_answer(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any] | None]:
    """The status a stream request gets, and a refusal's details (a stream is hung up on at once)."""
    with httpx.Client(timeout=10) as c, c.stream("GET", url, headers=headers) as r:
        if r.status_code == 200:
            return 200, None
        return r.status_code, json.loads(r.read())["error"]["details"]


@pytest.mark.postgres_only
def test_a_long_transaction_in_another_database_does_not_hold_the_feed(
    client: TestClient, tenant: TenantHandle
) -> None:
    """Only this database's transactions count: a shared cluster's other databases (other
    services, other test sessions) cannot stall the feed."""
    if backend_under_test() != "postgres":
        pytest.skip("Postgres only")
    other_url = create_postgres_database()
    engine = create_engine(other_url)
    try:
        with engine.connect() as other:
            other.execute(text("CREATE TABLE t (x int)"))
            other.execute(text("INSERT INTO t VALUES (1)"))  # holds an xid, uncommitted
            run = create_run(client, tenant, max_steps=10)
            report_step(client, run["id"], 1)
            actions = [e["action"] for e in all_events(client, tenant, run["id"])]
            assert actions[-1] == "run.step"
            other.rollback()
    finally:
        engine.dispose()
        drop_postgres_database(other_url)
