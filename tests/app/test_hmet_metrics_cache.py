"""GET /metrics reads the database at most once per `metrics_cache_seconds`, one reading at a time.

Each reading is a dozen counting queries over the runs, batches and step tables; /metrics is open by
default, and every scrape read them: 32 anonymous clients scraping for 12 s took another tenant's
GET /v1/runs from a 35 ms p95 to 1.4 s. Now a reading serves every scrape for a few seconds, a
scrape during a reading gets the previous figures (or, before the first reading ended, waits for
it: never two readings at once), and the request counts are at most a second old (the page's cache). A reading that stalls is given
up. With several workers a scrape waits for the reading under way. The pauses are
events in the reading, never sleeps. Both databases."""

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.config import Settings
from app.main import create_app
from app.telemetry.collector import DatabaseCollector
from tests.app.api import TenantHandle, create_run, new_tenant
from tests.app.test_prometheus import scrape, value

WAIT_S = 30.0
"""Only a bound for a broken test: every wait below ends on an event."""

SCRAPES = 8


class Readings:
    """Counts DatabaseCollector readings; `hold()` makes the next one stop at a pause point (after
    it is counted, before it reads) until `release()`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.entered = threading.Event()
        self.go_on = threading.Event()
        self.go_on.set()
        self._lock = threading.Lock()
        real = DatabaseCollector.collect

        def counted(collector_self: DatabaseCollector) -> Iterator[Any]:
            with self._lock:
                self.count += 1
                held = not self.go_on.is_set()
            if held:
                self.entered.set()
                assert self.go_on.wait(WAIT_S)
            yield from real(collector_self)

        monkeypatch.setattr(DatabaseCollector, "collect", counted)

    def hold(self) -> None:
        self.entered.clear()
        self.go_on.clear()

    def release(self) -> None:
        self.go_on.set()


@pytest.fixture
def readings(monkeypatch: pytest.MonkeyPatch) -> Readings:
    return Readings(monkeypatch)


def _client(settings: Settings, seconds: float) -> TestClient:
    return TestClient(create_app(settings.model_copy(update={"metrics_cache_seconds": seconds})))


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_scrapes_during_a_reading_get_the_previous_figures(settings: Settings, readings: Readings) -> None:
    """Even with no reuse at all (0 s), a scrape that comes while a reading is under way does not start
    another: it answers at once with the previous figures. (The page's own cache is bypassed: it
    would answer the previous page by itself.)"""
    with _client(settings, 0.0) as client:
        page = client.app.state.metrics_page  # type: ignore[attr-defined]
        page.get = page._read
        tenant = new_tenant(client)
        create_run(client, tenant)
        _, first = scrape(client)
        assert readings.count == 1 and value(first, "loraloom_runs_created_total") == 1
        create_run(client, tenant, name="second")

        readings.hold()
        slow, answers = _in_thread(lambda: scrape(client))
        assert readings.entered.wait(WAIT_S)  # the reading is under way, paused
        try:
            for _ in range(SCRAPES):  # each answers while that reading is still paused
                _, during = scrape(client)
                assert value(during, "loraloom_runs_created_total") == 1  # the previous figures
                assert value(during, "loraloom_database_up") == 1
            assert readings.count == 2, "a scrape started a reading of its own"
        finally:
            readings.release()
            slow.join(WAIT_S)
        assert value(answers[0][1], "loraloom_runs_created_total") == 2  # the paused one: fresh
        _, after = scrape(client)  # nothing under way now: 0 s means read again
        assert readings.count == 3 and value(after, "loraloom_runs_created_total") == 2


def test_the_figures_are_reused_for_the_configured_seconds(
    settings: Settings, readings: Readings, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    with _client(settings, 5.0) as client:
        cache = client.app.state.metrics_cache  # type: ignore[attr-defined]
        monkeypatch.setattr(cache, "_clock", lambda: now[0])
        client.app.state.metrics_page.ttl_s = 0.0  # type: ignore[attr-defined]  # (its own test below)
        tenant: TenantHandle = new_tenant(client)
        _, before = scrape(client)
        create_run(client, tenant)
        now[0] += 4.9
        _, cached = scrape(client)
        assert readings.count == 1
        assert value(cached, "loraloom_runs_created_total") == value(before, "loraloom_runs_created_total")
        # The request families are counted per request (the page aside): this scrape sees the previous one.
        route = {"method": "GET", "route": "/metrics", "status": "200"}
        assert value(cached, "loraloom_http_requests_total", **route) == (
            value(before, "loraloom_http_requests_total", **route) + 1
        )
        now[0] += 0.2  # 5.1 s after the reading ended
        _, fresh = scrape(client)
        assert readings.count == 2
        assert value(fresh, "loraloom_runs_created_total") == value(before, "loraloom_runs_created_total") + 1


def test_a_reading_that_raises_lets_the_next_scrape_read() -> None:
    from app.telemetry.collector import ScrapeCache

    calls: list[int] = []

    def read() -> list[Any]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return ["figures"]

    cache = ScrapeCache(read, ttl_s=5.0)
    with pytest.raises(RuntimeError):
        cache.get()
    assert cache.get() == ["figures"] and len(calls) == 2


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORALOOM_METRICS_CACHE_SECONDS", "2.5")
    assert Settings().metrics_cache_seconds == 2.5
    assert Settings.model_fields["metrics_cache_seconds"].default == 5.0
    monkeypatch.setenv("LORALOOM_METRICS_CACHE_SECONDS", "-1")
    with pytest.raises(ValueError):
        Settings()


def test_multiprocess_mode_shares_the_cache(
    settings: Settings, readings: Readings, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """With PROMETHEUS_MULTIPROC_DIR the route builds a registry per scrape; the database figures
    still come from the app's one cache."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with _client(settings, 5.0) as client:
        for _ in range(3):
            scrape(client)
        assert readings.count == 1


def test_a_stalled_reading_answers_the_database_down() -> None:
    """A reading that never ends (a database that stopped answering) served the last figures as
    healthy forever, and held every first scrape waiting without end: past STALLED_READING_S the
    scrapes answer `database_up 0` alone, at once."""
    from app.telemetry.collector import STALLED_READING_S, ScrapeCache

    now = [0.0]
    entered, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def read() -> list[Any]:
        calls.append(1)
        entered.set()
        assert release.wait(30), "never released"
        return [f"figures {len(calls)}"]

    def down(families: list[Any]) -> bool:
        (family,) = families
        return family.name == "loraloom_database_up" and [s.value for s in family.samples] == [0]

    cache = ScrapeCache(read, ttl_s=5.0, clock=lambda: now[0])
    first, out = _in_thread(cache.get)  # the first reading ever, held
    assert entered.wait(30)
    now[0] = STALLED_READING_S + 1
    assert down(cache.get())  # neither a wait without end nor figures
    release.set()
    first.join(30)
    assert out == [["figures 1"]]
    now[0] += 1
    assert cache.get() == ["figures 1"]  # fresh again

    entered.clear()
    release.clear()
    now[0] += 10  # expired: the next scrape reads, and that reading stalls
    second, out = _in_thread(cache.get)
    assert entered.wait(30)
    assert cache.get() == ["figures 1"]  # while it may still end: the previous figures
    now[0] += STALLED_READING_S + 1
    assert down(cache.get())
    release.set()
    second.join(30)
    assert out == [["figures 2"]] and len(calls) == 2


def test_the_page_is_rendered_once_a_second_at_most(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rendering costs with the number of series (a client's requests of every route, method and
    bad header made 740 KB of it, 0.25 s a rendering): scrapes within a second share one."""
    from prometheus_client import generate_latest

    from app.telemetry import setup

    rendered: list[int] = []
    real = generate_latest

    def counted(registry: Any) -> bytes:
        rendered.append(1)
        return real(registry)

    monkeypatch.setattr(setup, "generate_latest", counted)
    with _client(settings, 60.0) as client:
        page = client.app.state.metrics_page  # type: ignore[attr-defined]
        assert page.ttl_s == setup.PAGE_SECONDS
        now = [0.0]
        page._clock = lambda: now[0]
        first = client.get("/metrics")
        client.get("/v1/no-such-route")  # a new series, not in the page for this second
        assert client.get("/metrics").text == first.text and rendered == [1]
        now[0] = setup.PAGE_SECONDS
        assert "no-such-route" not in first.text
        assert client.get("/metrics").text != first.text and rendered == [1, 1]
    with _client(settings, 0.0) as client:  # no cache asked: every scrape renders
        assert client.app.state.metrics_page.ttl_s == 0.0  # type: ignore[attr-defined]


def _blocking_reads(
    hang_first: int,
) -> tuple[Callable[[], list[Any]], list[threading.Event], threading.Event]:
    """A read whose first `hang_first` calls each stop at a pause point until the returned event is
    set (each announces itself on its own event); later calls answer at once."""
    entered = [threading.Event() for _ in range(hang_first)]
    release = threading.Event()
    calls: list[int] = []

    def read() -> list[Any]:
        calls.append(1)
        n = len(calls)
        if n <= hang_first:
            entered[n - 1].set()
            assert release.wait(WAIT_S), "never released"
        return [f"figures {n}"]

    return read, entered, release


def _is_down(families: list[Any]) -> bool:
    (family,) = families
    return family.name == "loraloom_database_up" and [s.value for s in family.samples] == [0]


def test_a_stalled_reading_is_given_up_and_the_next_scrape_reads_again() -> None:
    """A reading that never ends (a hung connection) kept the cache answering the database down for
    good, even once the database answered again: past STALLED_READING_S the next scrape reads anew.
    At most one given-up reading is left running: a second stall answers down without a third."""
    from app.telemetry.collector import STALLED_READING_S, ScrapeCache

    now = [0.0]
    read, entered, release = _blocking_reads(hang_first=2)
    cache = ScrapeCache(read, ttl_s=5.0, clock=lambda: now[0])
    try:
        first, _ = _in_thread(cache.get)  # hangs
        assert entered[0].wait(WAIT_S)
        now[0] = STALLED_READING_S + 1
        assert _is_down(cache.get())  # gives the first up
        second, _ = _in_thread(cache.get)  # reads again: hangs too
        assert entered[1].wait(WAIT_S)
        now[0] += STALLED_READING_S + 1
        assert _is_down(cache.get())  # the first still hangs: no third reading
        assert _is_down(cache.get())
        release.set()  # the database answers again
        first.join(WAIT_S)
        second.join(WAIT_S)
        now[0] += 6  # both late answers have expired
        assert cache.get() == ["figures 3"]  # a fresh reading
    finally:
        release.set()


def test_a_given_up_reading_that_ends_late_does_not_replace_newer_figures() -> None:
    from app.telemetry.collector import STALLED_READING_S, ScrapeCache

    now = [0.0]
    read, entered, release = _blocking_reads(hang_first=1)
    cache = ScrapeCache(read, ttl_s=5.0, clock=lambda: now[0])
    try:
        first, out = _in_thread(cache.get)
        assert entered[0].wait(WAIT_S)
        now[0] = STALLED_READING_S + 1
        assert _is_down(cache.get())
        assert cache.get() == ["figures 2"]  # the next scrape's own reading
        release.set()
        first.join(WAIT_S)
        assert out == [["figures 1"]]
        assert cache.get() == ["figures 2"]  # not the older reading that ended last
    finally:
        release.set()


def _until(condition: Callable[[], bool], within: float = WAIT_S) -> None:
    """Wait for a condition another thread makes true (a bound for a broken test only)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.001)


def _waiting_cache_reading_again() -> tuple[Any, threading.Event]:
    """A cache of several workers (scrapes wait) that read "figures 1" and has expired: its next
    reading, "figures 2", stops at a pause point until the returned event is set."""
    from app.telemetry.collector import ScrapeCache

    now = [0.0]
    read, _, release = _blocking_reads(hang_first=2)
    cache = ScrapeCache(read, ttl_s=5.0, clock=lambda: now[0], previous_while_reading=False)
    release.set()
    assert cache.get() == ["figures 1"]
    release.clear()
    now[0] += 6
    return cache, release


def test_with_several_workers_a_scrape_waits_for_the_reading_under_way() -> None:
    """Each worker has its own cache: a worker's previous figures may be older than those another
    worker just answered, a counter going back (a reset to Prometheus). So there a scrape that
    comes during a reading waits for it (the cache counts it waiting) and gets the new figures."""
    cache, release = _waiting_cache_reading_again()
    try:
        leader, first = _in_thread(cache.get)
        _until(lambda: cache._reading is not None)
        follower, second = _in_thread(cache.get)
        _until(lambda: cache._waiting == 1)  # it waits, where one process answers at once
        assert not second
        release.set()
        leader.join(WAIT_S)
        follower.join(WAIT_S)
        assert first == second == [["figures 2"]]
    finally:
        release.set()


def test_only_a_few_scrapes_wait_the_others_get_the_previous_figures() -> None:
    """Each waiting scrape holds a thread of the pool: a flood of scrapers must not hold them all."""
    from app.telemetry.collector import MAX_WAITING_SCRAPES

    cache, release = _waiting_cache_reading_again()
    try:
        leader, _ = _in_thread(cache.get)
        _until(lambda: cache._reading is not None)
        waiters = [_in_thread(cache.get) for _ in range(MAX_WAITING_SCRAPES)]
        _until(lambda: cache._waiting == MAX_WAITING_SCRAPES)
        assert cache.get() == ["figures 1"]  # at once: the previous figures
        release.set()
        for thread, out in waiters:
            thread.join(WAIT_S)
            assert out == [["figures 2"]]
        leader.join(WAIT_S)
    finally:
        release.set()


@pytest.mark.parametrize("previous_while_reading", [True, False])
def test_before_any_reading_ended_only_a_few_scrapes_wait(previous_while_reading: bool) -> None:
    """With no previous figures concurrent scrapes wait for the one first reading (and all get its
    figures: none reads again), at most MAX_WAITING_SCRAPES of them (a cold start or a database hanging from the start must not let a
    flood of scrapers hold every thread); the others answer the database down at once."""
    from app.telemetry.collector import MAX_WAITING_SCRAPES, STALLED_READING_S, ScrapeCache

    read, entered, release = _blocking_reads(hang_first=1)
    cache = ScrapeCache(read, ttl_s=5.0, clock=lambda: 0.0, previous_while_reading=previous_while_reading)
    try:
        leader, first = _in_thread(cache.get)
        assert entered[0].wait(WAIT_S)
        waiters = [_in_thread(cache.get) for _ in range(MAX_WAITING_SCRAPES)]
        _until(lambda: cache._waiting == MAX_WAITING_SCRAPES)
        one_more, answer = _in_thread(cache.get)  # would wait until the reading stalls (30 s)
        _until(lambda: not one_more.is_alive(), within=STALLED_READING_S / 2)  # long before the stall
        assert _is_down(answer[0]) and cache._waiting == MAX_WAITING_SCRAPES
        release.set()
        leader.join(WAIT_S)
        for thread, out in waiters:
            thread.join(WAIT_S)
            assert out == [["figures 1"]]
        assert first == [["figures 1"]]
    finally:
        release.set()


@pytest.mark.parametrize("previous_while_reading", [True, False])
def test_the_figures_from_before_a_stall_are_not_served_as_up(previous_while_reading: bool) -> None:
    """Once a stalled reading is given up, the next reading may hang too: while it runs, scrapes
    answer the database down, not the figures read before the stall with `database_up 1`."""
    from app.telemetry.collector import STALLED_READING_S, ScrapeCache

    now = [0.0]
    read, entered, release = _blocking_reads(hang_first=3)
    cache = ScrapeCache(
        lambda: ["figures 0"] if not entered[0].is_set() and now[0] == 0.0 else read(),
        ttl_s=5.0,
        clock=lambda: now[0],
        previous_while_reading=previous_while_reading,
    )
    try:
        assert cache.get() == ["figures 0"]
        now[0] = 10.0  # expired
        _in_thread(cache.get)  # hangs
        assert entered[0].wait(WAIT_S)
        now[0] += STALLED_READING_S + 1
        assert _is_down(cache.get())  # given up
        _in_thread(cache.get)  # the next reading: hangs too
        assert entered[1].wait(WAIT_S)
        assert _is_down(cache.get())  # not ["figures 0"]
    finally:
        release.set()


def test_multiprocess_mode_makes_both_caches_wait(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with _client(settings, 5.0) as client:
        state = client.app.state  # type: ignore[attr-defined]
        assert not state.metrics_cache.previous_while_reading
        assert not state.metrics_page.previous_while_reading
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    with _client(settings, 5.0) as client:
        state = client.app.state  # type: ignore[attr-defined]
        assert state.metrics_cache.previous_while_reading and state.metrics_page.previous_while_reading
