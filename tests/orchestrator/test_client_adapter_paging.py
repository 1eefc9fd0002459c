"""The SDK over the real service's paged adapter listing (uvicorn, the test database):
`list_adapters` follows every page, each of a bounded size; `latest_adapter` is one request
(`newest_first=true&limit=1`) however many adapters the run keeps, None before the first; the
rollout loop finds its newest adapter with it and never lists. Requests are counted by the
transport the clients are given. Against a service from before paging (a stub transport) both
still answer right, and a cursor answered back unchanged ends the walk with an error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.config import Settings
from app.main import create_app
from app.pagination import MAX_LIMIT
from orchestrator.client import ADAPTER_PAGE_SIZE, AsyncLoraloomClient, LoraloomClient
from orchestrator.errors import ApiError
from orchestrator.loop import LoopConfig, RolloutLoop, StepReport
from tests.app.api import LiveServer, TenantHandle, create_run, new_tenant
from tests.app.test_adapter_paging import MANY, STEPS, add_adapters, publish_adapter
from tests.orchestrator.fakes import ScriptedSampler, solve
from tests.orchestrator.servers import FAST
from tests.orchestrator.test_loop_http import engine_for


class CountingTransport(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return super().handle_request(request)


class AsyncCountingTransport(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return await super().handle_async_request(request)


def listings(requests: list[httpx.Request], run_id: str) -> list[dict[str, str]]:
    """The query of each request to the run's adapter listing (not its downloads)."""
    return [dict(r.url.params) for r in requests if r.url.path == f"/v1/runs/{run_id}/adapters"]


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"run_adapters_kept": 0})  # the listing as long as the history


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def server(app: FastAPI) -> Iterator[LiveServer]:
    with LiveServer(app) as live:
        yield live


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
def tenant(http: httpx.Client) -> TenantHandle:
    return new_tenant(http)


def test_list_adapters_follows_every_page(
    server: LiveServer, http: httpx.Client, tenant: TenantHandle, settings: Settings
) -> None:
    assert ADAPTER_PAGE_SIZE <= MAX_LIMIT  # a page the service serves, not a 422
    run_id = create_run(http, tenant)["id"]
    add_adapters(settings, run_id, STEPS)
    transport = CountingTransport()
    with LoraloomClient(server.url, tenant.key, transport=transport) as client:
        adapters = client.list_adapters(run_id)
    assert [a.step for a in adapters] == STEPS  # each once, in step order
    assert adapters[0].sha256 == f"{STEPS[0]:064x}" and adapters[0].created_at is not None
    queries = listings(transport.requests, run_id)
    assert len(queries) == len(transport.requests) == -(-MANY // ADAPTER_PAGE_SIZE) == 2
    assert [q["limit"] for q in queries] == [str(ADAPTER_PAGE_SIZE)] * 2
    assert "cursor" not in queries[0] and queries[1]["cursor"]


def test_latest_adapter_is_one_request(
    server: LiveServer, http: httpx.Client, tenant: TenantHandle, settings: Settings
) -> None:
    run_id = create_run(http, tenant)["id"]
    transport = CountingTransport()
    with LoraloomClient(server.url, tenant.key, transport=transport) as client:
        assert client.latest_adapter(run_id) is None
        add_adapters(settings, run_id, STEPS)
        latest = client.latest_adapter(run_id)
    assert latest is not None
    assert (latest.step, latest.sha256, latest.size_bytes) == (STEPS[-1], f"{STEPS[-1]:064x}", STEPS[-1] + 1)
    assert listings(transport.requests, run_id) == [{"newest_first": "true", "limit": "1"}] * 2
    assert len(transport.requests) == 2


async def test_the_async_client_pages_and_reads_the_latest_alike(
    server: LiveServer, http: httpx.Client, tenant: TenantHandle, settings: Settings
) -> None:
    run_id = create_run(http, tenant)["id"]
    add_adapters(settings, run_id, STEPS)
    transport = AsyncCountingTransport()
    async with AsyncLoraloomClient(server.url, tenant.key, transport=transport) as client:
        latest = await client.latest_adapter(run_id)
        assert latest is not None and latest.step == STEPS[-1]
        assert len(transport.requests) == 1
        assert [a.step for a in await client.list_adapters(run_id)] == STEPS
    assert len(listings(transport.requests, run_id)) == len(transport.requests) == 3


async def test_the_loop_finds_its_newest_adapter_in_one_request(
    server: LiveServer, http: httpx.Client, tenant: TenantHandle, tmp_path: Path
) -> None:
    """Each iteration asks for the newest adapter once and downloads it when it is new: step 3 of
    three published, then step 4, published after the first iteration."""
    run_id = create_run(http, tenant, batch_size=4, max_async_level=100)["id"]
    for step in (1, 2, 3):
        publish_adapter(http, run_id, step)

    def publish_step_4(report: StepReport) -> None:
        if report.iteration == 0:
            publish_adapter(http, run_id, 4)

    sampler = ScriptedSampler(lambda p, j: solve(p) if j % 2 == 0 else "9")
    transport = AsyncCountingTransport()
    async with AsyncLoraloomClient(server.url, tenant.key, retry=FAST, transport=transport) as client:
        loop = RolloutLoop(
            client,
            engine_for(run_id, sampler),
            LoopConfig(
                max_iterations=2, adapter_dir=tmp_path, poll_interval_s=0.01, heartbeat_interval_s=None
            ),
            on_step=[publish_step_4],
        )
        await loop.run()
    assert [step for _, _, step in sampler.adapters] == [3, 4]
    assert listings(transport.requests, run_id) == [{"newest_first": "true", "limit": "1"}] * 2
    downloads = [r.url.path for r in transport.requests if "/adapters/" in r.url.path]
    assert downloads == [f"/v1/runs/{run_id}/adapters/3", f"/v1/runs/{run_id}/adapters/4"]


def _answering(body: dict[str, Any], seen: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=body)

    return httpx.MockTransport(handler)


RUN = "run_0123456789ab"
ITEMS = [{"step": s, "size_bytes": 1, "sha256": f"{s:064x}"} for s in (2, 5, 9)]


def test_a_service_from_before_paging_still_answers_both() -> None:
    """It ignores `limit`, `cursor` and `newest_first`: every adapter, oldest first, in one
    `{items}` without `next_cursor`."""
    seen: list[httpx.Request] = []
    transport = _answering({"items": ITEMS}, seen)
    with LoraloomClient("http://service", "key", transport=transport) as client:
        assert [a.step for a in client.list_adapters(RUN)] == [2, 5, 9]
        latest = client.latest_adapter(RUN)
    assert latest is not None and latest.step == 9  # the highest, not the first listed
    assert len(seen) == 2


def test_a_cursor_answered_back_unchanged_is_an_error_not_an_endless_walk() -> None:
    seen: list[httpx.Request] = []
    transport = _answering({"items": ITEMS, "next_cursor": "c2FtZQ"}, seen)
    with (
        LoraloomClient("http://service", "key", transport=transport) as client,
        pytest.raises(ApiError, match="does not go on past step 9"),
    ):
        client.list_adapters(RUN)
    assert [r.url.params.get("cursor") for r in seen] == [None, "c2FtZQ"]


@pytest.mark.parametrize(
    "pages",
    [
        # Cursors in a cycle, each page the same steps: a guard on the cursor alone never stops it.
        [({"items": ITEMS, "next_cursor": "QQ"}), ({"items": ITEMS, "next_cursor": "Qg"})],
        # Empty pages that always say there is more.
        [({"items": [], "next_cursor": "QQ"}), ({"items": [], "next_cursor": "Qg"})],
        # A page out of step order.
        [({"items": ITEMS[::-1], "next_cursor": None})],
    ],
    ids=["cycling-cursors", "empty-pages-with-a-cursor", "out-of-order"],
)
def test_pages_that_do_not_go_on_by_step_are_an_error_not_an_endless_walk(
    pages: list[dict[str, Any]],
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=pages[(len(seen) - 1) % len(pages)])

    with (
        LoraloomClient("http://service", "key", transport=httpx.MockTransport(handler)) as client,
        pytest.raises(ApiError, match="does not go on past step"),
    ):
        client.list_adapters(RUN)
    assert len(seen) <= 2
