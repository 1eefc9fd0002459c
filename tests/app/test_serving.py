"""The served protocol (app/serving.py): httptools with a header-size limit. What test_availability.py
does not cover: a head that outgrows the limit in many small reads, and request bodies, which are
never counted as head bytes (a keep-alive connection carries large bodies and later requests)."""

import json
import socket
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from app.config import Settings
from app.main import create_app
from app.serving import MAX_HEADER_BYTES, LimitedH11Protocol, LimitedHttpToolsProtocol, uvicorn_options
from tests.app.api import MSGPACK, LiveServer, batch_body, create_run, new_tenant


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    assert uvicorn_options()["http"] is LimitedHttpToolsProtocol
    with LiveServer(create_app(settings), **uvicorn_options()) as live:
        yield live


def _connect(server: LiveServer) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def test_a_head_growing_past_the_limit_in_small_reads_is_431(server):
    sock = _connect(server)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    sent = 0
    try:
        while sent < 4 * MAX_HEADER_BYTES:  # 1 KiB headers, one per send, never the blank line
            sock.sendall(b"X-Part-%06d: " % sent + b"a" * 1000 + b"\r\n")
            sent += 1016
            time.sleep(0.001)  # separate reads on the server's side
    except OSError:
        pass  # the service closed the connection once past the limit
    answer = _read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b'"request_header_fields_too_large"' in answer


@pytest.mark.parametrize("protocol", [LimitedHttpToolsProtocol, LimitedH11Protocol], ids=["httptools", "h11"])
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n",
        b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: z\r\n\r\n",
    ],
    ids=["header-without-colon", "bad-content-length"],
)
def test_malformed_http_gets_the_uniform_error_body(settings, protocol, request_bytes):
    """uvicorn answered malformed framing with a text/plain 400: every other error is the JSON body."""
    with LiveServer(create_app(settings), **{**uvicorn_options(), "http": protocol}) as live:
        sock = _connect(live)
        sock.sendall(request_bytes)
        answer = _read_all(sock)
        sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "bad_request" and error["message"].startswith("malformed HTTP request: ")


def test_bodies_are_not_head_bytes_on_a_kept_alive_connection(server):
    with httpx.Client(base_url=server.url, timeout=10) as http:
        tenant = new_tenant(http)
        run = create_run(http, tenant)
        for seed in range(3):
            content = msgspec.msgpack.encode(batch_body(400, seed=seed))
            assert len(content) > 2 * MAX_HEADER_BYTES  # counted as head bytes, it would be a 431
            r = http.post(
                f"/v1/runs/{run['id']}/batches",
                content=content,
                headers=tenant.headers | {"Content-Type": MSGPACK},
            )
            assert r.status_code == 201, r.text
            # A request after the body, on the same connection, is a fresh head.
            assert http.get("/healthz").status_code == 200


def _loaded_app(env: dict[str, str]) -> object:
    import uvicorn

    async def app(scope: object, receive: object, send: object) -> None:  # pragma: no cover - never called
        pass

    config = uvicorn.Config(app, **uvicorn_options(env))
    config.load()
    return config.loaded_app


def test_proxy_headers_only_when_trusted_proxies_are_configured():
    """Without FORWARDED_ALLOW_IPS no X-Forwarded-* layer wraps the app (one ASGI hop less per
    request); with it, uvicorn's ProxyHeadersMiddleware trusts those addresses."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    from app.serving import uvicorn_cli_args

    assert not isinstance(_loaded_app({}), ProxyHeadersMiddleware)
    assert not isinstance(_loaded_app({"FORWARDED_ALLOW_IPS": " "}), ProxyHeadersMiddleware)
    assert isinstance(_loaded_app({"FORWARDED_ALLOW_IPS": "10.0.0.1"}), ProxyHeadersMiddleware)
    assert "--no-proxy-headers" in uvicorn_cli_args({})
    assert "--proxy-headers" in uvicorn_cli_args({"FORWARDED_ALLOW_IPS": "10.0.0.1"})


def test_a_body_is_buffered_up_to_the_high_water_mark_before_reading_pauses():
    """uvicorn pauses a connection's socket reads once 64 KiB of body is unread; the service's protocol
    only past BODY_HIGH_WATER_BYTES (the request guard reads each body whole anyway)."""
    import asyncio
    from types import SimpleNamespace

    from app.serving import BODY_HIGH_WATER_BYTES

    pauses: list[int] = []
    protocol = LimitedHttpToolsProtocol.__new__(LimitedHttpToolsProtocol)
    protocol.parser = SimpleNamespace(should_upgrade=lambda: False)
    protocol.cycle = SimpleNamespace(body=bytearray(), response_complete=False, message_event=asyncio.Event())
    protocol.flow = SimpleNamespace(pause_reading=lambda: pauses.append(len(protocol.cycle.body)))
    protocol.on_body(b"x" * (BODY_HIGH_WATER_BYTES - 10))
    assert pauses == [] and protocol.cycle.message_event.is_set()
    protocol.on_body(b"x" * 20)
    assert pauses == [BODY_HIGH_WATER_BYTES + 10]
    assert len(protocol.cycle.body) == BODY_HIGH_WATER_BYTES + 10
