"""Hostile clients cannot take the service from others (issue 10), against real uvicorn configured
as `loraloom serve` configures it, on real Postgres:

- 40 partial-body uploads held open by one tenant: another tenant's GET /v1/runs answers 200
  while every one of them is provably still held (being read by the service, unanswered), no
  database connection is held by them, and each gets a 408 at its read deadline;
- a 1 MB header: 431 in the uniform body, /healthz answered while a large head is still arriving
  and after the refusal;
- per-tenant requests in flight and per-run pending batches: 429 + Retry-After, other tenants
  unaffected, nothing stored.
"""

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from app.batches import service as batches_service
from app.batches import storage
from app.batches.models import Batch
from app.config import Settings
from app.main import create_app
from app.runs import service as runs_service
from app.serving import MAX_HEADER_BYTES, uvicorn_options
from app.tinker import service as tinker_service
from tests.app.api import LiveServer, TenantHandle, batch_body, create_run, new_tenant
from tests.app.factories import committed, row_counts

HELD_UPLOADS = 40
HELD_PREFIX = b'{"examples": ['
"""What each held upload sends of its body (and never the rest)."""
VICTIM_REQUESTS = 10
BODY_DEADLINE_S = 6.0
"""The held uploads' read deadline: the victim's requests take well under a second together (more
than 10x less), so they all fall inside it; a victim starved until the uploads are let go gets
its answers only after their 408s, which the checks below see."""


@pytest.fixture
def served(settings: Settings) -> Iterator[tuple[LiveServer, Settings]]:
    settings = settings.model_copy(update={"body_timeout_seconds": BODY_DEADLINE_S})
    app = create_app(settings)
    with LiveServer(app, **uvicorn_options()) as server:
        yield server, settings


def _address(server: LiveServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def _wait_until(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def _nothing_received(sock: socket.socket) -> bool:
    """Whether nothing (no answer, no close) has arrived on `sock` so far."""
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


def _read_response(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_held_partial_bodies_do_not_starve_another_tenant(served):
    server, _settings = served
    with httpx.Client(base_url=server.url, timeout=10) as http:
        attacker, victim = new_tenant(http), new_tenant(http)
        run = create_run(http, attacker)
        create_run(http, victim)
        sockets = []
        try:
            head = (
                f"POST /v1/runs/{run['id']}/batches HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: {attacker.headers['Authorization']}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            ).encode()
            for _ in range(HELD_UPLOADS):
                sock = socket.create_connection(_address(server))
                sock.sendall(head + HELD_PREFIX)  # and never the rest
                sockets.append(sock)
            state = server.server.config.app.state
            engine = state.engine

            def held_bytes() -> int:
                """Body bytes the service is reading now: each held upload counts until it ends
                (408, disconnect), and no other request here has a body."""
                budget = getattr(state, "body_budget", None)
                return 0 if budget is None else int(budget.used)

            every_upload_held = HELD_UPLOADS * len(HELD_PREFIX)
            _wait_until(lambda: held_bytes() == every_upload_held, "every upload is being read", 30)
            for _ in range(VICTIM_REQUESTS):
                r = http.get("/v1/runs", headers=victim.headers)
                assert r.status_code == 200, r.text
                assert len(r.json()["items"]) == 1
                # Answered while every upload was still held: they only ever let go (a 408 at
                # their deadline), so still held now means held throughout the request. A victim
                # that waited for a thread or a connection they held would be answered only once
                # they were let go, and fail here.
                assert held_bytes() == every_upload_held, "the victim was answered after the uploads ended"
                assert all(_nothing_received(sock) for sock in sockets), "an upload was answered first"
                # The held uploads hold no database connection (the body is read before auth):
                # at most the sweeper's or a finishing request's, never one per upload.
                assert engine.pool.checkedout() <= 2
            assert http.get("/readyz").status_code == 200
            # At the read deadline each held upload gets a 408 in the uniform body (the timeout:
            # a hang guard only, 5x the deadline).
            answers = [_read_response(sock, timeout=30.0) for sock in sockets]
            assert all(a.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in a for a in answers), answers[
                0
            ]
            _wait_until(lambda: held_bytes() == 0, "the ended uploads count no more", 30)
        finally:
            for sock in sockets:
                sock.close()


def test_a_huge_header_is_431_and_healthz_is_unaffected(served):
    server, _settings = served
    # Never complete (no blank line): only the protocol's count of a head's bytes as they arrive can
    # refuse it; without it the service would read the whole megabyte and wait for more (a 408 at
    # the head deadline, 15 s), as httptools did for a 100 MB one.
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1024 * 1024)
    under_the_limit = MAX_HEADER_BYTES // 2
    sock = socket.create_connection(_address(server))
    with httpx.Client(base_url=server.url, timeout=10) as http:
        # A large head on its way (under the limit, so the service still waits for the rest):
        # /healthz is answered meanwhile, the head still unanswered.
        sock.sendall(big[:under_the_limit])
        assert http.get("/healthz").status_code == 200
        assert _nothing_received(sock), "the large head was answered before its end"
        # The rest, a megabyte: refused once past the limit, the connection closed.
        sender = threading.Thread(
            target=_send_ignoring_reset, args=(sock, big[under_the_limit:]), daemon=True
        )
        sender.start()
        answer = _read_response(sock, timeout=30.0)  # a hang guard only
        sender.join(timeout=30)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert b'"request_header_fields_too_large"' in answer
        assert http.get("/healthz").status_code == 200
        # A header just under the limit is still served; one just over it is a 431 even when the
        # whole head arrives in one read (h11 checks only heads still incomplete).
        r = http.get("/healthz", headers={"X-Fine": "a" * (MAX_HEADER_BYTES // 2)})
        assert r.status_code == 200
        r = http.get("/healthz", headers={"X-Big": "a" * (MAX_HEADER_BYTES + 100)})
        assert r.status_code == 431 and r.json()["error"]["code"] == "request_header_fields_too_large"


def _send_ignoring_reset(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the service closes the connection once past the limit
        sock.sendall(data)


@contextlib.contextmanager
def _one_request_held(monkeypatch, module: object, name: str, send) -> Iterator[None]:
    """Inside: `send()` (a request) runs in a thread, held in `module.name` (its handler's service
    call), so it is in flight; the other requests meanwhile run the real `name`. On leaving it is
    released and must have answered 200."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(module, name)

    def held(*args, **kwargs):
        entered.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)
    results: list[int] = []
    thread = threading.Thread(target=lambda: results.append(send().status_code))
    thread.start()
    assert entered.wait(10)
    monkeypatch.setattr(module, name, real)
    try:
        yield
    finally:
        release.set()
        thread.join(10)
    assert results == [200]


def _assert_rate_limited(r: httpx.Response) -> None:
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited", r.text
    assert int(r.headers["retry-after"]) >= 1


# SQLite (the embedded default) takes its write lock at BEGIN: one held transaction stalls every other
# request there, so per-tenant fairness is a Postgres property (README, "Hostile clients and limits").
@pytest.mark.postgres_only
def test_requests_in_flight_per_tenant_get_429(settings, monkeypatch):
    settings = settings.model_copy(update={"tenant_max_in_flight": 1})
    with (
        LiveServer(create_app(settings), **uvicorn_options()) as server,
        httpx.Client(base_url=server.url, timeout=10) as http,
    ):
        busy, other = new_tenant(http), new_tenant(http)
        with _one_request_held(
            monkeypatch, runs_service, "list_runs", lambda: http.get("/v1/runs", headers=busy.headers)
        ):
            _assert_rate_limited(http.get("/v1/runs/run_000000000000", headers=busy.headers))
            # Another tenant is not limited by the first one's requests.
            assert http.get("/v1/runs", headers=other.headers).status_code == 200
        assert http.get("/v1/runs", headers=busy.headers).status_code == 200


@pytest.mark.postgres_only
def test_tinker_requests_count_against_the_same_in_flight_limit(settings, monkeypatch):
    """The Tinker routes were not counted (review of 2026-11-23, M1): a tenant could hold every
    thread and database connection through /api/v1 while its /v1 requests got 429s."""
    settings = settings.model_copy(update={"tenant_max_in_flight": 1})
    with (
        LiveServer(create_app(settings), **uvicorn_options()) as server,
        httpx.Client(base_url=server.url, timeout=10) as http,
    ):
        busy, other = new_tenant(http), new_tenant(http)
        tinker_headers = {"X-API-Key": "tml-" + busy.key}
        with _one_request_held(
            monkeypatch,
            tinker_service,
            "capabilities",
            lambda: http.get("/api/v1/get_server_capabilities", headers=tinker_headers),
        ):
            _assert_rate_limited(http.post("/api/v1/create_session", json={}, headers=tinker_headers))
            _assert_rate_limited(http.get("/v1/runs", headers=busy.headers))  # one limit for both APIs
            other_headers = {"X-API-Key": "tml-" + other.key}
            assert http.get("/api/v1/get_server_capabilities", headers=other_headers).status_code == 200
        assert http.post("/api/v1/create_session", json={}, headers=tinker_headers).status_code == 200


def test_pending_batches_per_run_get_429(settings):
    settings = settings.model_copy(update={"run_max_pending_batches": 2})
    with TestClient(create_app(settings)) as client:
        tenant: TenantHandle = new_tenant(client)
        run = create_run(client, tenant)
        url = f"/v1/runs/{run['id']}/batches"
        for step in range(2):
            assert (
                client.post(url, json=batch_body(step=0, seed=step), headers=tenant.headers).status_code
                == 201
            )
        before = row_counts(settings, Batch)
        r = client.post(url, json=batch_body(seed=9), headers=tenant.headers)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["details"]["pending_batches"] == 2
        assert int(r.headers["retry-after"]) >= 1
        assert row_counts(settings, Batch) == before
        # Refused batches of later steps leave no (empty) step directory behind: one was left per step.
        rollouts = settings.data_dir / "runs" / run["id"] / "rollouts"
        steps_before = sorted(p.name for p in rollouts.iterdir())
        for step in range(1, 4):
            assert client.post(url, json=batch_body(step=step), headers=tenant.headers).status_code == 429
        assert sorted(p.name for p in rollouts.iterdir()) == steps_before
        # Once the pool has taken one, there is room again.
        with committed(settings) as session:
            first = session.query(Batch).order_by(Batch.id).first()
            assert first is not None
            first.state = "leased"
            session.commit()
        assert client.post(url, json=batch_body(seed=9), headers=tenant.headers).status_code == 201


@pytest.mark.parametrize("lean", [True, False], ids=["fast-path", "documented-route"])
def test_a_run_at_its_pending_limit_is_refused_before_its_payload_is_written(settings, monkeypatch, lean):
    """A client retrying at its run's pending limit made the service decode, write and fsync each
    attempt before the statement refused it; after one such refusal the run is checked first."""
    # No key cache: the documented route answers every request (app/batches/lean_route.py).
    cache_seconds = settings.api_key_cache_seconds if lean else 0.0
    settings = settings.model_copy(
        update={"run_max_pending_batches": 1, "api_key_cache_seconds": cache_seconds}
    )
    writes: list[str] = []
    real_write = batches_service.write_payload

    def counted_write(*args, **kwargs):
        writes.append(kwargs["run_id"])
        return real_write(*args, **kwargs)

    monkeypatch.setattr(batches_service, "write_payload", counted_write)
    with TestClient(create_app(settings)) as client:
        tenant: TenantHandle = new_tenant(client)
        run = create_run(client, tenant)
        url = f"/v1/runs/{run['id']}/batches"

        def post(seed: int) -> httpx.Response:
            return client.post(url, json=batch_body(seed=seed), headers=tenant.headers)

        assert post(0).status_code == 201
        assert post(1).status_code == 429  # the exact check, after the write: marks the run
        assert len(writes) == 2
        for seed in range(2, 6):
            r = post(seed)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["details"]["pending_batches"] == 1
            assert int(r.headers["retry-after"]) >= 1
        assert len(writes) == 2, "the refused batches were written"
        # Once the pool has taken the batch there is room again, found by the early check.
        with committed(settings) as session:
            session.execute(update(Batch).values(state="leased"))
            session.commit()
        assert post(9).status_code == 201
        assert len(writes) == 3


def test_a_retry_of_an_accepted_batch_gets_it_back_when_the_run_is_at_its_pending_limit(settings):
    """A client whose 201 was lost retries with the same Idempotency-Key; a run at its pending limit
    answered 429 until the pool claimed a batch (the SDK gave up, calling a stored batch refused)."""
    settings = settings.model_copy(update={"run_max_pending_batches": 1})
    with TestClient(create_app(settings)) as client:
        tenant: TenantHandle = new_tenant(client)
        run = create_run(client, tenant)
        url = f"/v1/runs/{run['id']}/batches"
        key = {**tenant.headers, "Idempotency-Key": "k1"}
        first = client.post(url, json=batch_body(seed=0), headers=key)
        assert first.status_code == 201, first.text
        replay = client.post(url, json=batch_body(seed=0), headers=key)  # the exact check refuses it
        assert (replay.status_code, replay.json()["id"]) == (200, first.json()["id"]), replay.text
        assert client.post(url, json=batch_body(seed=1), headers=tenant.headers).status_code == 429
        replay = client.post(url, json=batch_body(seed=0), headers=key)  # the early check refuses it
        assert (replay.status_code, replay.json()["id"]) == (200, first.json()["id"]), replay.text
        other = client.post(url, json=batch_body(seed=2), headers={**key, "Idempotency-Key": "k2"})
        assert other.status_code == 429, other.text  # a new key is still refused
        assert row_counts(settings, Batch) == (1,)


def test_a_payload_write_survives_its_step_directory_removed_under_it(settings, monkeypatch):
    """A refused batch removes its step's directory when it leaves it empty; a concurrent request may
    have just made that directory and not yet opened its file in it: the write makes it again."""
    real_open = os.open
    removed: list[str] = []

    def open_after_a_discard(path, flags, mode=0o777):
        if not removed:  # the window: after this request's mkdir, before its open
            removed.append(os.path.dirname(path))
            os.rmdir(os.path.dirname(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(storage.os, "open", open_after_a_discard)
    stored = storage.write_payload(settings, run_id="run_0123456789ab", rollout_step=7, data=b"payload")
    os.close(stored.lock_fd)
    assert removed  # the directory really was removed once
    assert (settings.data_dir / stored.relative_path).read_bytes() == b"payload"
