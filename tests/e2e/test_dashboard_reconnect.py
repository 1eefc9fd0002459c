"""The run page's live updates survive a refused event stream, in a real browser (Debian's chromium
through chromium-driver, as tests/e2e/test_dashboard_browser.py): the stream route answers 429 when
the tenant has all its requests or streams in flight, and a browser's EventSource gives up for good
on any non-200 answer, so the page stopped updating until reloaded (review). app/ui/static/run.js
opens it again after a pause. The refusal is made deterministic: the route refuses its first call."""

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.config import Settings
from app.errors import RateLimited
from app.events.router import event_stream
from app.main import create_app
from app.ui import router as ui_router
from tests.app.api import ADMIN_HEADERS, LiveServer

CHROMIUM = Path(os.environ.get("LORALOOM_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("LORALOOM_CHROMEDRIVER", "/usr/bin/chromedriver"))

pytestmark = [pytest.mark.slow]

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
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


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
        tenant = http.post("/v1/tenants", json={"name": "alice"}, headers=ADMIN_HEADERS).json()
        key = http.post(f"/v1/tenants/{tenant['id']}/keys", headers=ADMIN_HEADERS).json()["key"]
        auth = {"Authorization": f"Bearer {key}"}
        run_id = http.post("/v1/runs", json={"name": "r"}, headers=auth).json()["id"]

        browser.get(f"{server.url}/ui/login")
        browser.find_element(By.ID, "key").send_keys(key)
        browser.find_element(By.ID, "sign-in").click()
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda d: d.current_url.endswith("/ui/runs"))
        browser.get(f"{server.url}/ui/runs/{run_id}")
        wait.until(lambda _: len(calls) >= 1)  # the page's first stream: refused
        assert browser.find_element(By.ID, "status").text == "active"

        wait.until(lambda _: len(calls) >= 2)  # opened again by the page, without a reload
        evicted = http.post(f"/v1/runs/{run_id}/evict", json={"reason": "seen live"}, headers=auth)
        assert evicted.status_code == 200, evicted.text
        wait.until(lambda d: d.find_element(By.ID, "status").text == "evicted")
