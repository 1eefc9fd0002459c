"""The dashboard in a real browser: Debian's chromium, headless, driven by Selenium through
chromium-driver (`make browser` installs both), against the service under uvicorn and a real
worker pool training the run while the page is open."""

import os
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import Settings
from app.db import utcnow
from app.errors import RateLimited
from app.events import router as events_router
from app.events.router import event_stream
from app.main import create_app
from app.retention import purge_deleted_runs
from app.ui import router as ui_router
from tests.app.api import ADMIN_HEADERS, LiveServer
from tests.app.factories import committed
from tests.e2e.conftest import LiveService
from tests.e2e.helpers import MODEL_CACHE, kill_pool, run_config, run_status, start_pool, synthetic_batch

CHROMIUM = Path(os.environ.get("LORALOOM_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("LORALOOM_CHROMEDRIVER", "/usr/bin/chromedriver"))
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard_run.png"

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(
        f"no browser: {CHROMIUM} or {CHROMEDRIVER} is missing (run `make browser`, which installs Debian's "
        "chromium and chromium-driver)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402 - only once the browser is known to exist
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module", autouse=True)
def tiny_model_cached() -> None:
    """Build the tiny model's cache here, once, so the pool under test only loads it."""
    from trainer_core.models.registry import load_base_model

    load_base_model("loraloom-tiny", cache_dir=MODEL_CACHE)


def _tenant_key(service: LiveService, name: str) -> str:
    with service.admin() as admin:
        tenant = admin.post("/v1/tenants", json={"name": name, "max_concurrent_runs": 2})
        tenant.raise_for_status()
        key = admin.post(f"/v1/tenants/{tenant.json()['id']}/keys")
        key.raise_for_status()
        return str(key.json()["key"])


def _push(client: httpx.Client, run_id: str, seed: int, rollout_step: int) -> None:
    body = synthetic_batch(seed, n_samples=4, rollout_step=rollout_step)
    for i, example in enumerate(body["examples"]):
        example["reward"] = 0.25 * i + 0.5 * rollout_step  # the curve should rise
    r = client.post(f"/v1/runs/{run_id}/batches", json=body)
    assert r.status_code == 201, r.text


def _reward_points(driver: webdriver.Chrome) -> int:
    points = driver.find_element(By.CSS_SELECTOR, "#reward-chart .line").get_attribute("points") or ""
    return len(points.split())


def test_dashboard_in_chromium(live_service: LiveService, browser: webdriver.Chrome, tmp_path: Path) -> None:
    url = live_service.url
    alice_key, bob_key = _tenant_key(live_service, "alice"), _tenant_key(live_service, "bob")
    alice = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice_key}"}, timeout=30)
    bob = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {bob_key}"}, timeout=30)
    run_id = alice.post("/v1/runs", json={"name": "alice-grpo", "config": run_config(max_steps=10)}).json()[
        "id"
    ]
    bob_run = bob.post("/v1/runs", json={"name": "bob-secret", "config": run_config(max_steps=10)}).json()[
        "id"
    ]
    wait = WebDriverWait(browser, 90, poll_frequency=0.2)

    # Sign in with the key; the runs page lists Alice's run and not Bob's.
    browser.get(f"{url}/ui/login")
    browser.find_element(By.ID, "key").send_keys(alice_key)
    browser.find_element(By.ID, "sign-in").click()
    wait.until(lambda d: d.current_url.endswith("/ui/runs"))
    runs_table = browser.find_element(By.ID, "runs").text
    assert "alice-grpo" in runs_table and run_id in runs_table
    assert "bob-secret" not in browser.page_source and bob_run not in browser.page_source
    cookie = browser.get_cookie("loraloom_session")
    assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # not readable by scripts

    # Open the run; a real pool trains it while the page stays open (no reload: the marker survives).
    browser.find_element(By.LINK_TEXT, run_id).click()
    wait.until(lambda d: d.find_element(By.ID, "step").text == "0")
    browser.execute_script("window.__noReload = true")
    _push(alice, run_id, seed=1, rollout_step=0)
    pool = start_pool(url, data_dir=live_service.data_dir, nproc=1, log_path=tmp_path / "pool.log")
    try:
        # The pool's start (torchrun, the model) is slow on a loaded 2-core machine: a generous wait.
        WebDriverWait(browser, 300, poll_frequency=0.2).until(
            lambda d: d.find_element(By.ID, "step").text == "1"
        )
        assert _reward_points(browser) == 1
        _push(alice, run_id, seed=2, rollout_step=1)
        wait.until(lambda d: d.find_element(By.ID, "step").text == "2")
        wait.until(lambda d: _reward_points(d) == 2)
        loss_points = browser.find_element(By.CSS_SELECTOR, "#loss-chart .line").get_attribute("points")
        assert loss_points and len(loss_points.split()) == 2
        assert browser.execute_script("return window.__noReload") is True
        assert browser.find_element(By.ID, "progress").get_attribute("value") == "2"
        events = browser.find_element(By.ID, "events").text
        assert "run.step" in events and "batch.received" in events
        shot = tmp_path / "run.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size < 300_000
        if os.environ.get("LORALOOM_UPDATE_SCREENSHOT"):
            shutil.copyfile(shot, DOCS_SCREENSHOT)

        # A forged POST without the CSRF token, from the signed-in browser itself, is refused.
        status = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            f"fetch('/ui/runs/{run_id}/evict', {{method: 'POST', body: new URLSearchParams({{confirm: 'yes'}})}})"
            ".then(r => done(r.status));"
        )
        assert status == 403
        assert run_status(alice, run_id)["status"] == "active"

        # Evict through the form: confirm box, then the browser's confirmation dialog.
        browser.find_element(By.ID, "evict-reason").send_keys("seen enough")
        browser.find_element(By.ID, "evict-confirm").click()
        browser.find_element(By.ID, "evict-button").click()
        wait.until(lambda d: d.switch_to.alert).accept()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "evicted")
        out = run_status(alice, run_id)
        assert (
            out["status"] == "evicted"
            and out["evicted_by"] == "user"
            and out["eviction_reason"] == "seen enough"
        )
    finally:
        kill_pool(pool)

    # Sign out: the cookie no longer opens anything, in the browser or replayed by hand.
    browser.find_element(By.ID, "sign-out").click()
    wait.until(lambda d: d.current_url.endswith("/ui/login"))
    browser.get(f"{url}/ui/runs/{run_id}")
    assert browser.current_url.endswith("/ui/login")
    replay = httpx.get(
        f"{url}/ui/runs", cookies={"loraloom_session": cookie["value"]}, follow_redirects=False
    )
    assert replay.status_code == 303 and replay.headers["location"] == "/ui/login"
    alice.close()
    bob.close()


def _sign_in_and_open_a_run(
    browser: webdriver.Chrome, url: str, http: httpx.Client
) -> tuple[str, dict[str, str]]:
    """A new tenant signs in and opens the page of a new run; returns the run's id and the API headers."""
    tenant = http.post("/v1/tenants", json={"name": "alice"}, headers=ADMIN_HEADERS).json()
    key = http.post(f"/v1/tenants/{tenant['id']}/keys", headers=ADMIN_HEADERS).json()["key"]
    auth = {"Authorization": f"Bearer {key}"}
    run_id = http.post("/v1/runs", json={"name": "r"}, headers=auth).json()["id"]
    browser.get(f"{url}/ui/login")
    browser.find_element(By.ID, "key").send_keys(key)
    browser.find_element(By.ID, "sign-in").click()
    WebDriverWait(browser, 30, poll_frequency=0.2).until(lambda d: d.current_url.endswith("/ui/runs"))
    browser.get(f"{url}/ui/runs/{run_id}")
    return run_id, auth


# The run page's live updates survive a refused event stream: the stream route answers 429 when the
# tenant has all its requests or streams in flight, and a browser's EventSource gives up for good on
# any non-200 answer, so the page stopped updating until reloaded (review). app/ui/static/run.js opens
# it again after a pause. The refusal is made deterministic: the route refuses its first call.
def test_the_run_page_reconnects_after_a_refused_stream(
    settings: Settings, browser: webdriver.Chrome, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = event_stream

    def busy_first(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RateLimited("this tenant has 16 live event streams open", retry_after=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ui_router, "event_stream", busy_first)
    with LiveServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        run_id, auth = _sign_in_and_open_a_run(browser, server.url, http)
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda _: len(calls) >= 1)  # the page's first stream: refused
        assert browser.find_element(By.ID, "status").text == "active"

        wait.until(lambda _: len(calls) >= 2)  # opened again by the page, without a reload
        evicted = http.post(f"/v1/runs/{run_id}/evict", json={"reason": "seen live"}, headers=auth)
        assert evicted.status_code == 200, evicted.text
        wait.until(lambda d: d.find_element(By.ID, "status").text == "evicted")


class _RequestLog:
    """Records the path of every HTTP request the app is asked (the browser's, the test's own)."""

    def __init__(self, app: ASGIApp, *, paths: list[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


STREAM_SECONDS = 2.0
"""How long the service keeps a stream open here (an hour in production): as it ends each, the
browser opens it again by itself, so a page that still follows a run asks for its stream every few
seconds, and one that stopped asks nothing."""


@pytest.fixture
def logged_service(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[LiveServer, list[str]]]:
    monkeypatch.setattr(events_router, "SSE_MAX_SECONDS", STREAM_SECONDS)
    paths: list[str] = []
    app = create_app(settings)
    app.add_middleware(_RequestLog, paths=paths)
    with LiveServer(app) as server:
        yield server, paths


def _gone_notice(driver: webdriver.Chrome) -> str | None:
    notice = driver.find_element(By.ID, "gone")
    return notice.text if notice.is_displayed() else None


def _asks_no_more(paths: list[str], stream: str) -> None:
    """No request for the stream (or about it) while several streams would have ended and been opened again."""
    before = paths.count(stream)
    time.sleep(3 * STREAM_SECONDS + 4)
    assert paths.count(stream) == before, f"{paths.count(stream) - before} more requests for {stream}"


# A deleted run's stream went on being polled, and opened again whenever the service ended it, for as
# long as the page stayed open, and the page did not say the run was gone (review).
def test_the_run_page_stops_following_a_run_deleted_while_it_is_open(
    logged_service: tuple[LiveServer, list[str]], browser: webdriver.Chrome
) -> None:
    server, paths = logged_service
    with httpx.Client(base_url=server.url, timeout=30) as http:
        run_id, auth = _sign_in_and_open_a_run(browser, server.url, http)
        stream = f"/ui/runs/{run_id}/events"
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda _: paths.count(stream) >= 2)  # following the run: opened again as each ends
        assert _gone_notice(browser) is None
        assert _curves_shown(browser)

        assert http.delete(f"/v1/runs/{run_id}", headers=auth).status_code == 200
        assert wait.until(_gone_notice) == "This run was deleted."
        assert browser.find_element(By.ID, "status").text == "deleted"
        assert not _curves_shown(browser)  # its metrics went with it, as the API answers them
        _asks_no_more(paths, stream)

        # Opened again later, the page of the deleted run says so and opens no stream.
        browser.refresh()
        assert wait.until(_gone_notice) == "This run was deleted."
        assert not _curves_shown(browser)
        _asks_no_more(paths, stream)


def _curves_shown(driver: webdriver.Chrome) -> bool:
    """The charts are displayed, and no notice says the run's metrics were deleted."""
    notices = driver.find_elements(By.ID, "curves-deleted")
    return driver.find_element(By.ID, "charts").is_displayed() and not any(n.is_displayed() for n in notices)


# A stream refused with a 404 (the run's row gone) was asked for again every 2 s, 4 s, ... up to every
# 60 s for as long as the page stayed open: an EventSource cannot see the status, so the page asks with
# a plain request when its stream is refused, and stops on a 404 saying why (review). A deleted run's
# row stays until the sweeper purges it (LORALOOM_DELETED_RUN_RETENTION_SECONDS after the deletion);
# a page that followed the run saw its deletion (above), so here the page's streams are refused (429)
# from before the deletion until after the purge, which runs as the sweeper would run it then.
def test_the_run_page_stops_retrying_a_stream_answered_404(
    logged_service: tuple[LiveServer, list[str]],
    browser: webdriver.Chrome,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refusing: list[bool] = []
    real = event_stream

    def refused_once_busy(*args: Any, **kwargs: Any) -> Any:
        if refusing:
            raise RateLimited("this tenant has 16 live event streams open", retry_after=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ui_router, "event_stream", refused_once_busy)
    server, paths = logged_service
    with httpx.Client(base_url=server.url, timeout=30) as http:
        run_id, auth = _sign_in_and_open_a_run(browser, server.url, http)
        stream = f"/ui/runs/{run_id}/events"
        wait = WebDriverWait(browser, 60, poll_frequency=0.2)
        wait.until(lambda _: paths.count(stream) >= 1)
        refusing.append(True)
        asked = paths.count(stream)
        wait.until(lambda _: paths.count(stream) >= asked + 2)  # the stream ended, refused since

        assert http.delete(f"/v1/runs/{run_id}", headers=auth).status_code == 200
        retention = settings.deleted_run_retention_seconds
        with committed(settings) as session:
            later = utcnow() + timedelta(seconds=retention + 1)
            assert purge_deleted_runs(session, now=later, retention_seconds=retention).runs == [run_id]
        assert http.get(f"/v1/runs/{run_id}", headers=auth).status_code == 404
        assert (
            wait.until(_gone_notice)
            == "This run no longer exists: it was deleted. Nothing more will happen here."
        )
        _asks_no_more(paths, stream)
