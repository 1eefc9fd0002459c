"""What the Tinker routes answer where a limit is reached, read the way the official SDK (pinned,
unmodified) reads it:

- a `retrieve_future` long poll past `tinker_max_long_polls_per_tenant` waits in line for a place
  (no thread, no query, no place held) and answers "try again" if none comes up: the SDK polls
  again at once on that answer, while it backs off a 429 exponentially (1, 2, 4 ... 30 s), which
  made the results of a tenant with more futures than the cap arrive seconds late;
- `save_state` past `tinker_max_saves_per_tenant` is a 403, not a 409: the SDK retries every 408,
  409, 429 and 5xx of a submission for 5 minutes, whatever `x-should-retry` says, and retrying
  cannot make room. The 429s for a busy pool (pending requests and bytes, live sessions, in-flight
  requests) stay 429s: they clear by themselves, and the SDK should retry them.

Promptness is held by the order of events and the answers' statuses, never by a time bound (on 2
shared cores those are flaky): a poll answers while another still holds the place it would need;
every future has a poll waiting at the service when the pool finishes; the SDK got no answer that
it backs off from or retries.
"""

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import tinker
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import Settings
from app.errors import RateLimited
from app.main import create_app
from app.tinker import router as tinker_router
from app.tinker.long_polls import LongPolls
from app.tinker.models import TinkerFuture
from tests.app.api import WORKER_HEADERS, LiveServer, TenantHandle, new_tenant, register
from tests.app.test_tinker_long_polls import _pending, _wait_until

BASE_MODEL = "loraloom-tiny"


# --- the line itself ------------------------------------------------------------------------


def _run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def test_polls_past_the_cap_wait_in_line_and_are_handed_places_in_order():
    async def scenario() -> None:
        polls = LongPolls(2, most_waiting=10, retry_after=1)
        assert await polls.enter("t", wait_s=1) and await polls.enter("t", wait_s=1)
        order: list[int] = []

        async def waiter(n: int) -> None:
            assert await polls.enter("t", wait_s=5)
            order.append(n)

        waiters = []
        for n in range(3):
            waiters.append(asyncio.create_task(waiter(n)))
            await asyncio.sleep(0)  # each lines up before the next
        await asyncio.sleep(0.01)
        assert (polls.in_flight("t"), polls.waiting("t")) == (2, 3)
        assert await polls.enter("other", wait_s=0)  # another tenant's places are its own

        polls.leave("t")  # the place passes to the first in line: the count stays
        await asyncio.sleep(0.01)
        assert order == [0] and (polls.in_flight("t"), polls.waiting("t")) == (2, 2)
        polls.leave("t")
        polls.leave("t")
        await asyncio.gather(*waiters)
        assert order == [0, 1, 2] and (polls.in_flight("t"), polls.waiting("t")) == (2, 0)
        for _ in range(2):
            polls.leave("t")
        assert polls.in_flight("t") == 0

    _run(scenario)


def test_a_wait_that_ends_holds_nothing_and_a_full_line_is_a_429():
    async def scenario() -> None:
        polls = LongPolls(1, most_waiting=1, retry_after=3)
        assert await polls.enter("t", wait_s=0)
        started = time.monotonic()
        assert not await polls.enter("t", wait_s=0.05)  # no place came up: nothing held
        assert time.monotonic() - started >= 0.05
        assert (polls.in_flight("t"), polls.waiting("t")) == (1, 0)

        waiting = asyncio.create_task(polls.enter("t", wait_s=5))
        await asyncio.sleep(0.01)
        with pytest.raises(RateLimited) as refused:
            await polls.enter("t", wait_s=5)
        assert refused.value.retry_after == 3
        assert refused.value.details == {"limit": 1, "waiting": 1, "kind": "long_polls"}

        # A waiter cancelled (its client gone) after a place was handed to it passes it on.
        polls.leave("t")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert (polls.in_flight("t"), polls.waiting("t")) == (0, 0)

        # One cancelled while it waits leaves the line.
        assert await polls.enter("t", wait_s=0)
        gone = asyncio.create_task(polls.enter("t", wait_s=5))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert (polls.in_flight("t"), polls.waiting("t")) == (1, 0)
        polls.leave("t")
        assert polls.in_flight("t") == 0

    _run(scenario)


# --- the route ------------------------------------------------------------------------------


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[FastAPI, LiveServer]]:
    # One place; a line of 2 (the line is bounded by the tenant's pending requests).
    app = create_app(
        settings.model_copy(
            update={"tinker_max_long_polls_per_tenant": 1, "tinker_max_pending_per_tenant": 2}
        )
    )
    with LiveServer(app) as server:
        yield app, server


def _places(app: FastAPI, tenant_id: str) -> tuple[int, int]:
    """(the tenant's polls holding a place, those waiting in line); made on the first poll."""
    polls = getattr(app.state, "tinker_long_polls", None)
    if polls is None:
        return 0, 0
    assert isinstance(polls, LongPolls)
    return polls.in_flight(tenant_id), polls.waiting(tenant_id)


def _created(http: httpx.Client, model_id: str, headers: dict[str, str]) -> str:
    """The id of the model's completed creation future (the same create again answers it)."""
    body = {
        "session_id": model_id.split(":")[0],
        "model_seq_id": int(model_id.rsplit(":", 1)[1]),
        "base_model": BASE_MODEL,
        "lora_config": {"rank": 4, "train_unembed": False, "train_mlp": False},
    }
    r = http.post("/api/v1/create_model", json=body, headers=headers)
    assert r.status_code == 200, r.text
    request_id: str = r.json()["request_id"]
    return request_id


def _spy_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The futures the long polls look up (each a query in the threadpool)."""
    checked: list[str] = []
    real = tinker_router._retrieve_once

    def spying(*args: Any, **kwargs: Any) -> Any:
        checked.append(kwargs["request_id"])
        return real(*args, **kwargs)

    monkeypatch.setattr(tinker_router, "_retrieve_once", spying)
    return checked


@dataclass(frozen=True)
class _Entry:
    """One poll's `LongPolls.enter`, seen inside the server: the wait it was given, how long it took
    on the event loop's clock, and whether it got a place."""

    wait_s: float
    took_s: float
    got_place: bool


CLOCK_SLACK_S = 0.01
"""The event loop may run a timer up to its clock's resolution early (nanoseconds): a wait that
ended by its timeout took its wait_s less at most this."""


def _spy_entries(monkeypatch: pytest.MonkeyPatch) -> list[_Entry]:
    """Every poll's entry into the line that ended (a place, or its wait over), in that order."""
    entries: list[_Entry] = []
    real = LongPolls.enter

    async def spying(self: LongPolls, tenant_id: str, *, wait_s: float) -> bool:
        loop = asyncio.get_running_loop()
        started = loop.time()
        got_place = await real(self, tenant_id, wait_s=wait_s)
        entries.append(_Entry(wait_s=wait_s, took_s=loop.time() - started, got_place=got_place))
        return got_place

    monkeypatch.setattr(LongPolls, "enter", spying)
    return entries


def test_a_poll_past_the_cap_waits_without_a_place_or_a_query_then_says_try_again(served, monkeypatch):
    app, server = served
    # The first poll holds the place for longer than the client waits (30 s): the second one can
    # answer only by its own wait in line ending, never by a place coming up.
    monkeypatch.setattr(tinker_router, "LONG_POLL_S", 60.0)
    monkeypatch.setattr(tinker_router, "LONG_POLL_WAIT_S", 2.0)
    checked = _spy_checks(monkeypatch)
    entries = _spy_entries(monkeypatch)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        tenant = new_tenant(http)
        model_id, pending, headers = _pending(http, tenant)
        done = _created(http, model_id, headers)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            held = asyncio.create_task(
                c.post("/api/v1/retrieve_future", json={"request_id": pending}, headers=headers)
            )
            await asyncio.to_thread(_wait_until, lambda: _places(app, tenant.id)[0] == 1, "held")
            waiting = asyncio.create_task(
                c.post("/api/v1/retrieve_future", json={"request_id": done}, headers=headers)
            )
            answer = await waiting
            # It waited in line, its whole wait, for no place (the SDK polls again at once on "try
            # again", so an answer at once would make it poll in a tight loop).
            held_entry, waited = entries
            assert held_entry.got_place
            assert not waited.got_place and waited.wait_s == 2.0, waited
            assert waited.took_s >= waited.wait_s - CLOCK_SLACK_S, waited
            # "Try again" once its wait is over, while the first poll still holds the place: it
            # did not wait for the place.
            assert answer.status_code == 200, answer.text
            said = answer.json()
            assert said["type"] == "try_again" and said["request_id"] == done, said
            assert said["queue_state"] == "active", said
            assert not held.done()
            assert done not in checked  # never looked up: no query, no thread, no place
            assert _places(app, tenant.id) == (1, 0)
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
            await asyncio.to_thread(_wait_until, lambda: _places(app, tenant.id)[0] == 0, "freed")

    asyncio.run(scenario())


def test_a_waiting_poll_takes_the_place_that_frees_and_a_full_line_is_a_429(served, monkeypatch):
    app, server = served
    monkeypatch.setattr(tinker_router, "LONG_POLL_S", 60.0)
    monkeypatch.setattr(tinker_router, "LONG_POLL_WAIT_S", 60.0)
    checked = _spy_checks(monkeypatch)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        tenant = new_tenant(http)
        model_id, pending, headers = _pending(http, tenant)
        done = _created(http, model_id, headers)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:

            def poll(request_id: str) -> "asyncio.Task[httpx.Response]":
                return asyncio.create_task(
                    c.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
                )

            held = poll(pending)
            await asyncio.to_thread(_wait_until, lambda: _places(app, tenant.id)[0] == 1, "held")
            waiters = [poll(done), poll(done)]
            await asyncio.to_thread(_wait_until, lambda: _places(app, tenant.id)[1] == 2, "in line")

            # The line holds at most the tenant's pending requests (2 here): one more is refused.
            refused = await c.post("/api/v1/retrieve_future", json={"request_id": done}, headers=headers)
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == str(tinker_router.LONG_POLL_RETRY_AFTER_SECONDS)
            error = refused.json()["error"]
            assert error["code"] == "rate_limited"
            assert error["details"] == {"limit": 1, "waiting": 2, "kind": "long_polls"}
            assert done not in checked

            # The held poll's client goes: at its next check it hands the place to the first in line,
            # which answers the result at once and hands it on. Both the held poll's hold and the
            # waits in line (60 s) outlast the client's timeout (30 s, a hang guard): a result can
            # only come from the place being handed on.
            assert not any(w.done() for w in waiters)
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
            answers = await asyncio.gather(*waiters)
            assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
            assert [a.json()["model_id"] for a in answers] == [model_id, model_id]
            assert checked.count(done) == 2
            await asyncio.to_thread(_wait_until, lambda: _places(app, tenant.id)[0] == 0, "freed")
            assert _places(app, tenant.id) == (0, 0)

    asyncio.run(scenario())


# --- through the official SDK ---------------------------------------------------------------


class _Statuses:
    """ASGI middleware: the status of every answer on `path` (`retrieve_future` unless told), in
    order."""

    def __init__(self, app: ASGIApp, statuses: list[int], path: str = "/api/v1/retrieve_future") -> None:
        self.app = app
        self.statuses = statuses
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.statuses.append(message["status"])
            await send(message)

        await self.app(scope, receive, sending)


def _sdk(server: LiveServer, tenant: TenantHandle) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.url, api_key="tml-" + tenant.key)


def _training(service: tinker.ServiceClient) -> Any:
    return service.create_lora_training_client(
        base_model=BASE_MODEL, rank=4, train_unembed=False, train_mlp=False
    ).result()


def _saves(db: Session, tenant_id: str) -> int:
    db.expire_all()
    n = db.scalar(
        select(func.count())
        .select_from(TinkerFuture)
        .where(TinkerFuture.tenant_id == tenant_id, TinkerFuture.kind == "save_weights")
    )
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return n or 0


def _run_pool(http: httpx.Client, pool_id: str, count: int) -> None:
    """The pool runs `count` Tinker requests (they are saves: a result with metrics completes them)."""
    done = 0
    deadline = time.monotonic() + 30
    while done < count:
        assert time.monotonic() < deadline, f"the pool ran {done} of {count} requests"
        r = http.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS)
        assert r.status_code == 200, r.text
        for item in sorted(r.json()["items"], key=lambda i: i["seq_id"]):
            result = {"request_id": item["request_id"], "metrics": {"step": 1}}
            r = http.post(
                "/v1/pool/manual/results",
                json={"pool_id": pool_id, "results": [result]},
                headers=WORKER_HEADERS,
            )
            assert r.status_code == 200, r.text
            done += 1


def test_the_sdk_gets_every_result_promptly_with_more_futures_than_the_cap(settings, db):
    """Cap 2, six futures waiting for the pool: the four polls past the cap wait in line, none is
    refused (a 429 sent the SDK into 1, 2, 4 ... s of backoff), so when the pool is done every
    future has a poll at the service to take its result, and the SDK never backs off."""
    app = create_app(settings.model_copy(update={"tinker_max_long_polls_per_tenant": 2}))
    statuses: list[int] = []
    app.add_middleware(_Statuses, statuses=statuses)

    def every_future_polled() -> bool:
        """Each of the six futures has a poll at the service (two hold a place, four wait in
        line); or a poll was refused, and the SDK backs off instead."""
        polls: LongPolls | None = getattr(app.state, "tinker_long_polls", None)
        return 429 in statuses or (
            polls is not None and (polls.in_flight(tenant.id), polls.waiting(tenant.id)) == (2, 4)
        )

    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        pool_id = register(http)
        tenant = new_tenant(http)
        service = _sdk(server, tenant)
        try:
            training = _training(service)
            futures = [training.save_state(f"s{i}") for i in range(6)]
            _wait_until(lambda: _saves(db, tenant.id) == 6, "the six saves are stored")
            _wait_until(every_future_polled, "two places are held and four polls wait in line")
            assert 429 not in statuses, statuses

            _run_pool(http, pool_id, 6)
            paths = [f.result(timeout=30).path for f in futures]  # the timeout: a hang guard only
        finally:
            service.close("success").result()
    assert paths == [f"tinker://{training.model_id}/weights/s{i}" for i in range(6)]
    # Every answer was a result or a "try again", both of which the SDK follows with its next poll
    # at once: no 429 (exponential backoff), no 408 or 5xx (retries), nothing it gave up on.
    assert statuses and set(statuses) == {200}, statuses
    print(f"retrieve_future answers: {statuses}")


def test_save_state_past_the_quota_raises_at_once_through_the_sdk(settings, db):
    app = create_app(settings.model_copy(update={"tinker_max_saves_per_tenant": 1}))
    statuses: list[int] = []
    app.add_middleware(_Statuses, statuses=statuses, path="/api/v1/save_weights")
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        tenant = new_tenant(http)
        service = _sdk(server, tenant)
        try:
            training = _training(service)
            training.save_state("kept")  # pending (no pool): it is kept, the quota is full
            _wait_until(lambda: _saves(db, tenant.id) == 1, "the first save is stored")
            with pytest.raises(tinker.PermissionDeniedError) as refused:
                # A 409 was retried for 5 minutes before the SDK raised it (the timeout: a hang
                # guard only; the count below is what says "at once").
                training.save_state("one_more").result(timeout=15)
        finally:
            service.close("success").result()
    # One submission of "one_more", answered 403 and not retried.
    assert statuses == [200, 403], statuses
    assert refused.value.status_code == 403
    assert "LORALOOM_TINKER_MAX_SAVES_PER_TENANT = 1" in str(refused.value)
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["code"] == "save_quota"
    assert _saves(db, tenant.id) == 1  # nothing stored
