"""A request whose client leaves before its body's end is not run (hostile probe, 2026-11-29).

The request guard read the body until the server reported the disconnect and handed the route
what had arrived as if it were the whole body. A prefix can still parse, as something else than
what was sent: a TOML run config cut at a line boundary was stored with the default learning rate
instead of the one sent; a JSON body whose declared length was longer than the body made its
run; a batch likewise. The client, having seen no answer, retried with its Idempotency-Key and got
a 409 (the stored body differed). Now such a request runs nothing, stores nothing, and is counted
as a 499 (client closed request) in the request metrics.

Each case waits for the server to have seen the disconnect (the 499 counted), not for a sleep.
"""

import asyncio
import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import Message, Receive, Scope

from app.config import Settings
from app.main import create_app
from app.request_guard import CLIENT_GONE, BodyGuard
from app.serving import uvicorn_options
from app.telemetry.http import UNMATCHED
from tests.app.api import LiveServer, batch_body, create_run, new_tenant

TOML_BODY = b'name = "cut-short"\n[config]\nmax_steps = 3\n\n[config.optim]\nlr = 5e-5\n'


@pytest.fixture
def live(settings: Settings) -> Iterator[tuple[FastAPI, LiveServer]]:
    app = create_app(settings)
    with LiveServer(app, **uvicorn_options()) as server:
        yield app, server


def _aborted(app: FastAPI) -> float:
    value = app.state.metrics_registry.get_sample_value(
        "loraloom_http_requests_total", {"method": "POST", "route": UNMATCHED, "status": "499"}
    )
    return value or 0.0


def _send_and_leave(
    server: LiveServer, path: str, headers: dict[str, str], sent: bytes, declared: int
) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    head = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Length: {declared}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + sent)
        sock.shutdown(socket.SHUT_WR)  # the client is done sending: the body will never be whole


def _wait_for_aborts(app: FastAPI, count: float) -> None:
    deadline = time.monotonic() + 30  # a hang guard only: the server sees the close at once
    while _aborted(app) < count:
        assert time.monotonic() < deadline, "the server never saw the client leave"
        time.sleep(0.01)


def test_a_run_config_cut_short_is_not_created(live) -> None:
    app, server = live
    with httpx.Client(base_url=server.url, timeout=10) as http:
        tenant = new_tenant(http)
        cut = TOML_BODY[: TOML_BODY.index(b"[config.optim]")]  # still valid TOML
        toml_headers = tenant.headers | {"Content-Type": "application/toml", "Idempotency-Key": "k-toml"}
        _send_and_leave(server, "/v1/runs", toml_headers, cut, len(TOML_BODY))
        whole_json = json.dumps({"name": "cut-json", "config": {"max_steps": 3}}).encode()
        json_headers = tenant.headers | {"Content-Type": "application/json"}
        _send_and_leave(server, "/v1/runs", json_headers, whole_json, len(whole_json) + 50)
        _wait_for_aborts(app, 2)

        assert http.get("/v1/runs", headers=tenant.headers).json()["items"] == []
        # the client's retry of the whole body is the first request of that key: a 201, not a 409
        retried = http.post("/v1/runs", content=TOML_BODY, headers=toml_headers)
        assert retried.status_code == 201, retried.text
        assert retried.json()["config"]["optim"]["lr"] == 5e-5


def test_a_batch_cut_short_is_not_stored(live) -> None:
    app, server = live
    with httpx.Client(base_url=server.url, timeout=10) as http:
        tenant = new_tenant(http)
        run = create_run(http, tenant)
        body = json.dumps(batch_body()).encode()
        headers = tenant.headers | {"Content-Type": "application/json"}
        path = f"/v1/runs/{run['id']}/batches"
        before = _aborted(app)
        _send_and_leave(server, path, headers, body, len(body) + 10)
        _wait_for_aborts(app, before + 1)
        assert http.get(path, headers=tenant.headers).json()["items"] == []
        # the same body, whole, is taken
        assert http.post(path, content=body, headers=headers).status_code == 201
        assert len(http.get(path, headers=tenant.headers).json()["items"]) == 1


def _guard_sees_a_disconnect_first(
    headers: list[tuple[bytes, bytes]], body: bytes = b""
) -> tuple[tuple[bytes, Receive] | None, Scope]:
    """The guard's check of a POST whose client the server saw leave before the guard read a byte of
    the body (what arrives then is `body`, then the disconnect): the window made certain, where a live
    server may read a short request whole before it sees the close."""
    messages = [{"type": "http.request", "body": body, "more_body": True}] if body else []
    messages.append({"type": "http.disconnect"})

    async def receive() -> Message:
        return messages.pop(0)

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/runs/run_0123456789ab/heartbeat",
        "headers": headers,
    }
    guard = BodyGuard(max_body_bytes=1 << 20, max_small_body_bytes=1 << 20, body_timeout_seconds=5)
    checked = asyncio.run(guard.check(scope, receive, send))
    assert sent == []  # nothing is answered: no answer could reach the client
    return checked, scope


@pytest.mark.parametrize("headers", [[], [(b"content-length", b"0")]], ids=["no length", "length 0"])
def test_a_request_that_declares_no_body_is_whole_though_its_client_left(headers) -> None:
    """A heartbeat sent and not waited for: no body was declared, so none was cut; it is run (a run
    would otherwise miss its heartbeat), not counted as abandoned."""
    checked, scope = _guard_sees_a_disconnect_first(headers)
    assert checked is not None and checked[0] == b""
    assert CLIENT_GONE not in scope


@pytest.mark.parametrize(
    "headers, body",
    [
        ([(b"content-length", b"10")], b""),
        ([(b"content-length", b"10")], b"12345"),
        ([(b"transfer-encoding", b"chunked")], b"12345"),
    ],
    ids=["nothing of 10", "5 of 10", "chunked, no last chunk"],
)
def test_a_body_that_did_not_arrive_whole_is_not_run(headers, body) -> None:
    checked, scope = _guard_sees_a_disconnect_first(headers, body)
    assert checked is None and scope[CLIENT_GONE] is True
