"""`retrieve_future` long polls are counted per tenant (hostile probe 2, finding 4): at most
`tinker_max_long_polls_per_tenant` check their futures at once; the others wait in line for a place
on the event loop (no thread, no query; app/tinker/long_polls.py, and tests/app/test_tinker_retry_hints.py
for the line's own bounds and the official SDK's view of it). Each check holds one of the tenant's
in-flight places while it runs, and a poll whose client has gone gives its place back. Uncounted,
300 polls of one tenant slowed another tenant's requests from 12 ms to 1.2 s.

The polls are held open deterministically: a future that never completes (an optim_step with no
pool) and a long poll made longer than the test."""

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import tinker
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.config import Settings
from app.errors import RateLimited
from app.limits import InFlight
from app.main import create_app
from app.tinker import router as tinker_router
from app.tinker.long_polls import LongPolls
from tests.app.api import LiveServer, TenantHandle, new_tenant
from tests.app.test_tinker_work import _model

MOST = 3


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"tinker_max_long_polls_per_tenant": MOST})


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[FastAPI, LiveServer]]:
    app = create_app(settings)
    with LiveServer(app) as server:
        yield app, server


def _pending(client: Any, tenant: TenantHandle) -> tuple[str, str, dict[str, str]]:
    """(model id, the id of a future that stays pending: no pool claims it, headers)."""
    model_id, headers = _model(client, tenant)
    step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}}
    r = client.post("/api/v1/optim_step", json=step, headers=headers)
    assert r.status_code == 200, r.text
    return model_id, r.json()["request_id"], headers


def _wait_until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _polls(app: FastAPI) -> LongPolls | None:
    return getattr(app.state, "tinker_long_polls", None)


def _open(app: FastAPI, tenant_id: str) -> int:
    polls = _polls(app)
    return 0 if polls is None else polls.in_flight(tenant_id)


def _waiting(app: FastAPI, tenant_id: str) -> int:
    polls = _polls(app)
    return 0 if polls is None else polls.waiting(tenant_id)


def test_a_tenant_holds_at_most_its_long_polls_and_others_are_unaffected(served, monkeypatch):
    app, server = served
    monkeypatch.setattr(tinker_router, "LONG_POLL_S", 60.0)  # held open for the whole test
    with httpx.Client(base_url=server.url, timeout=30) as http:
        hog, victim = new_tenant(http), new_tenant(http)
        hog_model, future, hog_headers = _pending(http, hog)
        victim_model, _, victim_headers = _pending(http, victim)

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=MOST + 8)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as c:
            poll = {"request_id": future}
            held = [
                asyncio.create_task(c.post("/api/v1/retrieve_future", json=poll, headers=hog_headers))
                for _ in range(MOST)
            ]
            await asyncio.to_thread(_wait_until, lambda: _open(app, hog.id) == MOST, "3 polls are open")

            # One more waits in line: it holds no place and looks nothing up.
            waiting = asyncio.create_task(c.post("/api/v1/retrieve_future", json=poll, headers=hog_headers))
            await asyncio.to_thread(_wait_until, lambda: _waiting(app, hog.id) == 1, "one poll waits")
            assert _open(app, hog.id) == MOST

            # Between checks a poll holds no in-flight place: the hog's own requests still run,
            # and so do another tenant's, Tinker and /v1 alike.
            for model_id, headers in ((hog_model, hog_headers), (victim_model, victim_headers)):
                r = await c.post("/api/v1/get_info", json={"model_id": model_id}, headers=headers)
                assert r.status_code == 200, r.text
            assert (await c.get("/v1/runs", headers=victim.headers)).status_code == 200
            assert _open(app, victim.id) == 0

            # The clients go away: each poll notices at its next check and gives its place back (to
            # the waiting poll first, which finds its client gone before any check, and passes it on).
            for task in [*held, waiting]:
                task.cancel()
            await asyncio.gather(*held, waiting, return_exceptions=True)
            await asyncio.to_thread(_wait_until, lambda: _open(app, hog.id) == 0, "the places are back")
            assert _waiting(app, hog.id) == 0

    asyncio.run(scenario())


def test_a_poll_that_ends_gives_its_place_back(client, tenant, monkeypatch):
    monkeypatch.setattr(tinker_router, "LONG_POLL_S", 0.2)
    _, future, headers = _pending(client, tenant)
    for _ in range(MOST + 2):  # more polls, one after another, than a tenant may hold at once
        r = client.post("/api/v1/retrieve_future", json={"request_id": future}, headers=headers)
        assert r.status_code == 200 and r.json()["type"] == "try_again", r.text
    assert _polls(client.app) is not None  # the polls were counted
    assert _open(client.app, tenant.id) == 0
    # A poll refused by its check (another tenant's future: 404) gives its place back too.
    other = new_tenant(client)
    r = client.post(
        "/api/v1/retrieve_future", json={"request_id": future}, headers={"X-API-Key": "tml-" + other.key}
    )
    assert r.status_code == 404, r.text
    assert _open(client.app, other.id) == 0


def test_each_check_holds_an_in_flight_place_and_waits_for_one(settings, monkeypatch):
    """A check runs only with one of the tenant's in-flight places (its thread and database
    connection); with all of them taken, the poll waits instead of adding to them."""
    monkeypatch.setattr(tinker_router, "LONG_POLL_S", 0.3)
    with TestClient(create_app(settings.model_copy(update={"tenant_max_in_flight": 1}))) as client:
        tenant = new_tenant(client)
        model_id, headers = _model(client, tenant)
        done = client.post(
            "/api/v1/create_model",  # the same model again: its completed creation future
            json={
                "session_id": model_id.split(":")[0],
                "model_seq_id": 0,
                "base_model": "loraloom-tiny",
                "lora_config": {"rank": 4, "train_unembed": False, "train_mlp": False},
            },
            headers=headers,
        ).json()["request_id"]
        in_flight: InFlight = client.app.state.in_flight
        seen: list[int] = []
        real = tinker_router._retrieve_once

        def spying(*args: Any, **kwargs: Any) -> Any:
            seen.append(in_flight.in_flight(tenant.id))
            return real(*args, **kwargs)

        monkeypatch.setattr(tinker_router, "_retrieve_once", spying)
        in_flight.acquire(tenant.id)  # the tenant's only place, taken
        try:
            r = client.post("/api/v1/retrieve_future", json={"request_id": done}, headers=headers)
            assert r.json()["type"] == "try_again"  # never checked
            assert seen == []
        finally:
            in_flight.release(tenant.id)
        r = client.post("/api/v1/retrieve_future", json={"request_id": done}, headers=headers)
        assert r.json()["model_id"] == model_id
        assert seen == [1]  # the check held the place
        assert in_flight.in_flight(tenant.id) == 0


def test_the_official_sdks_poll_waits_in_line_and_gets_its_result(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the tenant's only place taken, the SDK's poll waits in line, is handed the place when
    the other poll ends, and answers the result: no 429 (which the SDK backs off from, up to 30 s).

    The other poll (the hog's) is held open until the SDK's poll has lined up, and only then ends
    (its client goes away): however slow the SDK is to poll, it finds the place taken."""
    monkeypatch.setattr(tinker_router, "LONG_POLL_S", 600.0)  # the hog's poll ends when its client goes
    app = create_app(settings.model_copy(update={"tinker_max_long_polls_per_tenant": 1}))
    release_hog = threading.Event()
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        tenant = new_tenant(http)
        _, future, headers = _pending(http, tenant)

        async def hog_poll() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=None) as c:
                poll = asyncio.create_task(
                    c.post("/api/v1/retrieve_future", json={"request_id": future}, headers=headers)
                )
                await asyncio.to_thread(release_hog.wait)
                poll.cancel()  # the client goes: its poll gives the place back at its next check
                await asyncio.gather(poll, return_exceptions=True)

        hog = threading.Thread(target=asyncio.run, args=(hog_poll(),))
        hog.start()
        try:
            _wait_until(lambda: _open(app, tenant.id) == 1, "the hog's poll is open")
            polls = _polls(app)
            assert polls is not None
            lined_up: list[bool] = []
            refusals: list[str] = []
            real_enter = polls.enter

            async def counting(tenant_id: str, *, wait_s: float) -> bool:
                lined_up.append(polls.in_flight(tenant_id) >= polls.most)
                # The hog may go now: `real_enter` puts this poll in line before it yields to the
                # event loop, which is where the server notices that the hog's client has gone.
                release_hog.set()
                try:
                    return await real_enter(tenant_id, wait_s=wait_s)
                except RateLimited:
                    refusals.append(tenant_id)
                    raise

            monkeypatch.setattr(polls, "enter", counting)
            service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + tenant.key)
            try:
                training = service.create_lora_training_client(
                    base_model="loraloom-tiny", rank=4, train_unembed=False, train_mlp=False
                ).result()
                assert training.model_id.endswith(":train:0")
            finally:
                service.close("success").result()
        finally:
            release_hog.set()
            hog.join(timeout=30)
        assert lined_up[0], "the SDK's poll found a place free: the test did not test the line"
        assert refusals == []
        assert _open(app, tenant.id) == 0  # the hog's place went to the SDK's poll, which gave it back
