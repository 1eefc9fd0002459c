"""The request front against one tenant taking it from the others, and against text the client
never sent (app/request_guard.py):

- the process's budget of body bytes being read (`max_buffered_body_bytes`) was shared by all:
  one tenant with a valid key held nine 60 MB batch bodies nearly whole, filling the 512 MiB, and
  every other tenant's request with a body (a 4 KB run create) was a 503 until they ended. A body
  whose tenant the guard knows before reading it (the tenants' and the Tinker API's bulk routes)
  now counts against that tenant's share too (`tenant_max_buffered_body_bytes`, half the budget
  by default): past it, that tenant gets a 429 of its own, and the others keep the rest;
- a path whose percent-decoding is not UTF-8 reached the routes with U+FFFD in place of its bytes
  (`run run_\\ufffd\\ufffd not found`); it is a 422, as is such a query parameter.

Bodies are stalled by the test's own sockets (the raw-HTTP helpers of test_front_limits.py) and
waited for by condition (the budget's count), never by a sleep that hopes to land in a window.
"""

import select
import socket
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.config import Settings
from app.key_cache import ApiKeyCache
from app.main import create_app
from app.request_guard import BodyBudget, tenant_body_share
from app.serving import uvicorn_options
from tests.app.api import ADMIN_HEADERS, MSGPACK, LiveServer, Response, new_tenant
from tests.app.factories import Seeded, batch_count, rollout_files, seed_run
from tests.app.test_front_anonymous_bulk import _post_big
from tests.app.test_front_limits import _budget_used, _closed, _connect, _head, _read_response, _wait_until

KIB = 1024
MIB = 1024 * KIB
BUDGET = 256 * KIB
"""The process's budget in these tests: a tenant's share is half, 128 KiB."""

DECLARED = MIB
"""What a stalled body declares (over the 64 KiB under which the guard does not look a key up)."""

HELD = 64 * KIB
"""What a stalled body sends of it: two fill a tenant's share, four the whole budget."""

FIRST = 4 * KIB
"""A stalled body's first bytes, sent alone: a body refused at them has nothing left unread."""

ROUTES = [
    pytest.param("/v1/runs/{run}/batches", MSGPACK, id="batches"),
    pytest.param("/v1/adapters?name=a", "application/x-tar", id="adapters"),
    pytest.param("/api/v1/forward_backward", "application/json", id="tinker-forward-backward"),
]


def _credential(path: str, seeded: Seeded) -> dict[str, str]:
    if path.startswith("/api/v1/"):
        return {"X-API-Key": "tml-" + seeded.secret}
    return seeded.headers


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _stall(
    app: FastAPI, server: LiveServer, path: str, headers: dict[str, str]
) -> tuple[socket.socket, tuple[int, dict[str, str], bytes] | None]:
    """A socket that sent the head of a DECLARED-byte POST and HELD bytes of it (counted in the
    budget when this returns); or, when the guard refused its first bytes, that socket and the
    refusal (status, headers, body)."""
    before = max(_budget_used(app), 0)
    sock = _connect(server)
    sock.sendall(_head("POST", path, headers, DECLARED) + b"\0" * FIRST)
    _wait_until(
        lambda: _readable(sock) or _budget_used(app) == before + FIRST, "its first bytes are taken or refused"
    )
    if _readable(sock):
        return sock, _read_response(sock)
    sock.sendall(b"\0" * (HELD - FIRST))
    _wait_until(lambda: _budget_used(app) == before + HELD, "its bytes are counted")
    return sock, None


@pytest.fixture
def budgeted(settings: Settings) -> Iterator[tuple[FastAPI, LiveServer]]:
    # A long body deadline: the stalled bodies must outlive the test's requests.
    app = create_app(
        settings.model_copy(update={"max_buffered_body_bytes": BUDGET, "body_timeout_seconds": 30.0})
    )
    app.state.api_key_cache = ApiKeyCache(60.0)  # a key cached below stays so for the whole test
    with LiveServer(app, **uvicorn_options()) as server:
        yield app, server


@pytest.mark.parametrize("cached", [True, False], ids=["cached-key", "looked-up-key"])
@pytest.mark.parametrize(("route", "content_type"), ROUTES)
def test_one_tenants_stalled_bodies_leave_the_others_their_uploads(
    budgeted: tuple[FastAPI, LiveServer], route: str, content_type: str, cached: bool
) -> None:
    app, server = budgeted
    settings: Settings = app.state.settings
    evil, acme = seed_run(settings), seed_run(settings)
    path = route.format(run=evil.run_id)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        if cached:  # the key's tenant from the key cache (the hot path); else from the guard's lookup
            assert http.get("/v1/runs", headers=evil.headers).status_code == 200
        stalled: list[socket.socket] = []
        try:
            answers = []
            for _ in range(4):  # what fills the whole budget, were the tenant not limited to its share
                sock, answer = _stall(
                    app, server, path, _credential(path, evil) | {"Content-Type": content_type}
                )
                stalled.append(sock)
                answers.append(answer)
            assert [answer is None for answer in answers] == [True, True, False, False]
            for answer, sock in zip(answers[2:], stalled[2:], strict=True):
                assert answer is not None
                status, headers, body = answer
                assert status == 429, body
                assert headers["retry-after"] == "1" and headers["connection"] == "close"
                assert _closed(sock)
                error = httpx.Response(status, content=body).json()["error"]
                assert (
                    error["code"] == "rate_limited" and "tenant_max_buffered_body_bytes" in error["message"]
                )
                assert error["details"] == {"limit": BUDGET // 2, "kind": "buffered_body_bytes"}
            budget: BodyBudget = app.state.body_budget
            assert budget.used == 2 * HELD and budget.by_tenant == {evil.tenant_id: 2 * HELD}

            # Another tenant: a run created (a small body, no tenant known before it is read) and a
            # batch (a bulk body counted against its own share), beside evil's stalled bodies.
            r = http.post(
                "/v1/runs",
                json={"name": "victim", "config": {"metadata": {"pad": "p" * 4000}}},
                headers=acme.headers,
            )
            assert r.status_code == 201, r.text
            assert _post_big(http, acme, 0, msgpack=True).status_code == 201
        finally:
            for sock in stalled:
                sock.close()
        _wait_until(lambda: _budget_used(app) == 0, "every body gave its place back")
        assert app.state.body_budget.by_tenant == {}
        assert _post_big(http, evil, 1, msgpack=True).status_code == 201  # evil's own uploads work again
    assert batch_count(settings) == 2 and len(rollout_files(settings)) == 2


def test_a_tenants_one_body_is_taken_whole_and_a_second_only_within_its_share(settings: Settings) -> None:
    """A share of 64 KiB: a tenant's 88 KiB batch is taken when it is the tenant's only body (a body
    up to its route's limit is never refused for good); beside a stalled 32 KiB of the same
    tenant, it is a 429 (its own limit), though the process's budget has room for it."""
    app = create_app(
        settings.model_copy(
            update={
                "max_buffered_body_bytes": 1024 * KIB,
                "tenant_max_buffered_body_bytes": 64 * KIB,
                "body_timeout_seconds": 30.0,
            }
        )
    )
    seeded = seed_run(settings)
    with (
        LiveServer(app, **uvicorn_options()) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        assert _post_big(http, seeded, 0, msgpack=True).status_code == 201  # alone: taken whole
        sock = _connect(server)
        try:
            sock.sendall(
                _head(
                    "POST",
                    f"/v1/runs/{seeded.run_id}/batches",
                    seeded.headers | {"Content-Type": MSGPACK},
                    DECLARED,
                )
                + b"\0" * (32 * KIB)
            )
            _wait_until(lambda: _budget_used(app) == 32 * KIB, "the stalled body is counted")
            r = _post_big(http, seeded, 1, msgpack=True)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["details"] == {"limit": 64 * KIB, "kind": "buffered_body_bytes"}
            assert _budget_used(app) == 32 * KIB  # the refused body gave back what it took
        finally:
            sock.close()
        _wait_until(lambda: _budget_used(app) == 0, "the stalled body's place is free")
        assert _post_big(http, seeded, 1, msgpack=True).status_code == 201
    assert batch_count(settings) == 2


def test_at_the_defaults_a_tenant_uploads_four_of_the_largest_bodies_at_once(settings: Settings) -> None:
    """The share's default is half the budget: four `max_body_bytes` bodies of one tenant arriving
    at once (more than honest uploads hold: a batch of 256 sequences of 4,096 tokens is about
    10 MB, and arrives in well under a second), and the other half left to the other tenants."""
    defaults = {name: field.default for name, field in Settings.model_fields.items()}
    assert defaults["tenant_max_buffered_body_bytes"] is None
    assert tenant_body_share(settings) == defaults["max_buffered_body_bytes"] // 2 == 256 * MIB
    largest = settings.max_body_bytes
    assert largest == 64 * MIB
    budget = BodyBudget(settings.max_buffered_body_bytes, tenant_body_share(settings))
    for _ in range(4):
        assert budget.take(largest, held=0, tenant_id="a") is None
    assert budget.take(1, held=0, tenant_id="a") == "tenant"
    for _ in range(4):  # another tenant still has the other half
        assert budget.take(largest, held=0, tenant_id="b") is None
    assert budget.take(1, held=0, tenant_id="c") == "service"  # the whole budget: everyone's 503
    assert budget.take(1, held=0) == "service"


def test_the_share_is_a_setting_and_a_body_alone_for_its_tenant_may_pass_it(settings: Settings) -> None:
    tuned = settings.model_copy(update={"tenant_max_buffered_body_bytes": 10 * MIB})
    assert tenant_body_share(tuned) == 10 * MIB
    budget = BodyBudget(100 * MIB, tenant_body_share(tuned))
    assert budget.take(30 * MIB, held=0, tenant_id="a") is None  # its only body
    assert budget.take(5 * MIB, held=30 * MIB, tenant_id="a") is None  # the same body, growing
    assert budget.take(1, held=0, tenant_id="a") == "tenant"  # a second body of the tenant
    assert budget.take(1, held=0) is None  # no tenant known: the process's budget only
    budget.give(35 * MIB, "a")
    budget.give(1)
    assert (budget.used, budget.by_tenant) == (0, {})


# ----------------------------------------------------------------------------- finding 2


def _not_utf8(r: Response, loc: list[str]) -> None:
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error" and "\ufffd" not in r.text
    assert error["details"] == [
        {"loc": loc, "msg": "not UTF-8 once percent-decoded", "type": "unicode_error"}
    ]


def test_a_path_or_query_that_is_not_utf8_once_decoded_is_a_422(settings: Settings) -> None:
    app = create_app(settings)
    with TestClient(app) as client:
        tenant = new_tenant(client)
        _not_utf8(client.get("/v1/runs/run_%ff%fe", headers=tenant.headers), ["path"])
        _not_utf8(client.delete("/v1/tenants/%ff/keys/%fe", headers=ADMIN_HEADERS), ["path"])
        _not_utf8(client.post("/v1/runs/run_%c3/batches", content=b"{}", headers=tenant.headers), ["path"])
        _not_utf8(client.get("/v1/runs?cursor=%ff", headers=tenant.headers), ["query", "cursor"])
        _not_utf8(client.get("/v1/runs?limit=10&cursor=ok%e9", headers=tenant.headers), ["query", "cursor"])
        _not_utf8(client.get("/v1/runs?%ff=1", headers=tenant.headers), ["query"])
        r = client.post("/v1/adapters?name=%ff%fe", content=b"x" * 100, headers=tenant.headers)
        _not_utf8(r, ["query", "name"])
        # UTF-8 is taken, U+FFFD itself included (sent as its UTF-8 bytes)
        r = client.get("/v1/runs/run_%EF%BF%BD", headers=tenant.headers)
        assert r.status_code == 404, r.text
        r = client.get("/v1/runs/run_%C3%A9?limit=5&x=%C3%A9", headers=tenant.headers)
        assert r.status_code == 404, r.text
        assert client.get("/v1/adapters", headers=tenant.headers).json()["items"] == []
