"""The SDK's bounds on one HTTP exchange (orchestrator/bounded.py) against a hostile server: a bare
socket server that trickles its answer, declares or streams far more than the client's cap, or
reads an upload a little at a time. The client must end with `DeadlineExceeded`, having hung up
while the server still had more to trickle or read (no wall-clock bound is asserted: on 2 shared
cores those are flaky), or `ResponseTooLarge` having read no more than its cap and a chunk; normal
answers still pass."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from loraloom.commands.errors import CliError, ExitCode
from loraloom.commands.http import request as cli_request
from orchestrator import errors
from orchestrator.client import AsyncLoraloomClient, LoraloomClient
from tests.orchestrator.fake_service import FakeService

RUN = "run_0123456789ab"
CAP = 1024 * 1024
PIECE = 16 * 1024
SLACK = 256 * 1024
"""Bytes the server may get into the two sockets' buffers (16 KiB each way, doubled by the kernel)
and the client's one 64 KiB read past its cap: what "sent" may exceed "read" by."""
TRICKLE_EVERY_S = 0.05
TRICKLE_FOR_S = 20.0
"""How long the trickling scripts go on before they end the answer themselves (cut short): 20x the
deadlines of the tests here, so a client whose deadline works has always hung up before, and one
whose deadline does not fails on the cut answer instead of hanging."""
UPLOAD_BYTES = 16 * CAP
"""The slowly read uploads: 40 s of the reader's 400 KiB/s, 40x the transfer deadline."""
SMALL_BUFFERS = [(socket.SOL_SOCKET, socket.SO_RCVBUF, PIECE), (socket.SOL_SOCKET, socket.SO_SNDBUF, PIECE)]
"""The client's socket buffers, pinned small: what the server managed to send is then close to what
the client read (a default loopback buffer holds megabytes), and a slowly read upload wakes the
client's writes often (each one making progress before its per-operation timeout)."""


class RawServer:
    """HTTP/1.1 by hand on 127.0.0.1, in a thread: `script(server, conn)` answers each connection;
    `body_sent` counts the answer bytes after the headers that the kernel accepted, `received` the
    request bytes a script read after the headers, `connections` the connections accepted.
    `client_left` is set when a script found the client gone (an OSError: a reset, a broken pipe,
    an end of stream), `script_ended` when a script ran to its end by itself (for the trickles:
    the server cut the answer short)."""

    def __init__(self, script: Callable[[RawServer, socket.socket], None]) -> None:
        self.script = script
        self.body_sent = 0
        self.received = 0
        self.connections = 0
        self.client_left = threading.Event()
        self.script_ended = threading.Event()
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> RawServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.listener.close()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PIECE)
            self.connections += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                read_headers(conn)
                self.script(self, conn)
            except OSError:  # the client hanging up ends the script
                self.client_left.set()
            else:
                self.script_ended.set()

    def body(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.body_sent += len(data)


def read_headers(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("client hung up")
        data += chunk
    return data


def _trickling(server: RawServer) -> Iterator[None]:
    """A step every TRICKLE_EVERY_S, for TRICKLE_FOR_S at least (the sleeps only get longer)."""
    for _ in range(int(TRICKLE_FOR_S / TRICKLE_EVERY_S)):
        if server.stop.wait(TRICKLE_EVERY_S):
            return
        yield


def trickle_body(server: RawServer, conn: socket.socket) -> None:
    """A complete header, then a byte every 50 ms of a 1 MB body (each read is quick), cut short
    after TRICKLE_FOR_S."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n")
    for _ in _trickling(server):
        server.body(conn, b" ")


def trickle_headers(server: RawServer, conn: socket.socket) -> None:
    """A header that never ends, a byte every 50 ms (no response object ever reaches the client),
    cut short after TRICKLE_FOR_S."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in _trickling(server):
        conn.sendall(b"a")


def huge_length(server: RawServer, conn: socket.socket) -> None:
    """Declares 10x the cap and sends it."""
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (10 * CAP)
    )
    for _ in range(10 * CAP // PIECE):
        server.body(conn, b" " * PIECE)


def endless_chunks(server: RawServer, conn: socket.socket) -> None:
    """Chunked, no length: 10x the cap, a chunk at a time."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(10 * CAP // PIECE):
        server.body(conn, b"%x\r\n%s\r\n" % (PIECE, b" " * PIECE))
    server.body(conn, b"0\r\n\r\n")


def slow_reader(server: RawServer, conn: socket.socket) -> None:
    """Takes an upload 4 KiB per 10 ms (400 KiB/s): every write makes progress, none ends soon."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PIECE)
    while not server.stop.is_set():
        data = conn.recv(4096)
        if not data:
            raise OSError("the client hung up")
        server.received += len(data)
        time.sleep(0.01)


def _sync(url: str, **kwargs: object) -> LoraloomClient:
    transport = httpx.HTTPTransport(socket_options=SMALL_BUFFERS)
    return LoraloomClient(url, "llk_test", max_attempts=1, transport=transport, **kwargs)  # type: ignore[arg-type]


def _async(url: str, **kwargs: object) -> AsyncLoraloomClient:
    transport = httpx.AsyncHTTPTransport(socket_options=SMALL_BUFFERS)
    return AsyncLoraloomClient(url, "llk_test", max_attempts=1, transport=transport, **kwargs)  # type: ignore[arg-type]


@contextlib.contextmanager
def ended_by_the_client(server: RawServer) -> Iterator[None]:
    """The call inside ended, and the client ended the exchange: `server` saw it hang up while its
    script still had more to trickle or read (the trickles go on for TRICKLE_FOR_S; a client
    without a working deadline gets their cut answer, or sends an upload to its end). An order of
    events rather than a time bound, which the 2 shared cores make flaky."""
    yield
    # A hang guard only: the server notices within a trickle step or two of the client leaving.
    assert server.client_left.wait(30), "the server never saw the client hang up"
    assert not server.script_ended.is_set(), "the server ended the answer, not the client's deadline"


# ---- the deadline ---------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [trickle_body, trickle_headers], ids=["body", "headers"])
def test_a_trickled_answer_ends_at_the_deadline(script: Callable[[RawServer, socket.socket], None]) -> None:
    with (
        RawServer(script) as server,
        ended_by_the_client(server),
        _sync(server.url, deadline=1.0, timeout=30.0) as client,
        pytest.raises(errors.DeadlineExceeded) as caught,
    ):
        client.get_run(RUN)
    assert caught.value.limit_s == 1.0 and caught.value.url == f"GET {server.url}/v1/runs/{RUN}"
    assert f"{server.url}/v1/runs/{RUN}" in str(caught.value) and "1s" in str(caught.value)


@pytest.mark.parametrize("script", [trickle_body, trickle_headers], ids=["body", "headers"])
async def test_async_a_trickled_answer_ends_at_the_deadline(
    script: Callable[[RawServer, socket.socket], None],
) -> None:
    with RawServer(script) as server, ended_by_the_client(server):
        async with _async(server.url, deadline=1.0, timeout=30.0) as client:
            with pytest.raises(errors.DeadlineExceeded) as caught:
                await client.get_run(RUN)
    assert caught.value.limit_s == 1.0


def test_an_upload_read_slowly_ends_at_the_transfer_deadline(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(os.urandom(UPLOAD_BYTES))
    with (
        RawServer(slow_reader) as server,
        ended_by_the_client(server),
        _sync(server.url, transfer_deadline=1.0, timeout=30.0) as client,
        pytest.raises(errors.DeadlineExceeded) as caught,
    ):
        client.upload_adapter(tmp_path)
    assert caught.value.url == f"POST {server.url}/v1/adapters?name=adapter"
    # The client stopped mid-upload (without a transfer deadline the whole file goes, in 40 s).
    assert server.received < UPLOAD_BYTES // 2, server.received


async def test_async_an_upload_read_slowly_ends_at_the_transfer_deadline(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(os.urandom(UPLOAD_BYTES))
    with RawServer(slow_reader) as server, ended_by_the_client(server):
        async with _async(server.url, transfer_deadline=1.0, timeout=30.0) as client:
            with pytest.raises(errors.DeadlineExceeded):
                await client.upload_adapter(tmp_path)
    assert server.received < UPLOAD_BYTES // 2, server.received


def test_a_deadline_is_not_retried() -> None:
    transport = httpx.HTTPTransport(socket_options=SMALL_BUFFERS)
    with (
        RawServer(trickle_body) as server,
        ended_by_the_client(server),
        LoraloomClient(server.url, "llk_test", deadline=0.5, transport=transport) as client,
        pytest.raises(errors.DeadlineExceeded),
    ):
        client.get_run(RUN)  # five attempts allowed
    # One attempt: a retry needs a new connection (the first one was cut mid-answer).
    assert server.connections == 1


# ---- the size cap ---------------------------------------------------------------------------------


def test_a_content_length_over_the_cap_is_refused_unread() -> None:
    with RawServer(huge_length) as server, _sync(server.url, max_response_bytes=CAP) as client:
        tracemalloc.start()
        try:
            with pytest.raises(errors.ResponseTooLarge) as caught:
                client.get_run(RUN)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert caught.value.declared == 10 * CAP and caught.value.limit_bytes == CAP
    assert "max_response_bytes" in str(caught.value) and f"{server.url}/v1/runs/{RUN}" in str(caught.value)
    assert server.body_sent <= SLACK and peak < CAP


def test_an_endless_chunked_answer_stops_at_the_cap() -> None:
    with RawServer(endless_chunks) as server, _sync(server.url, max_response_bytes=CAP) as client:
        tracemalloc.start()
        try:
            with pytest.raises(errors.ResponseTooLarge) as caught:
                client.get_run(RUN)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert caught.value.declared is None and "max_response_bytes" in str(caught.value)
    # The server got no more than the cap and one chunk (plus what the socket buffers hold) out.
    assert server.body_sent <= CAP + SLACK and peak < 2 * CAP


async def test_async_an_endless_chunked_answer_stops_at_the_cap() -> None:
    with RawServer(endless_chunks) as server:
        async with _async(server.url, max_response_bytes=CAP) as client:
            with pytest.raises(errors.ResponseTooLarge):
                await client.get_run(RUN)
    assert server.body_sent <= CAP + SLACK


async def test_async_a_content_length_over_the_cap_is_refused_unread() -> None:
    with RawServer(huge_length) as server:
        async with _async(server.url, max_response_bytes=CAP) as client:
            with pytest.raises(errors.ResponseTooLarge) as caught:
                await client.get_run(RUN)
    assert caught.value.declared == 10 * CAP and server.body_sent <= SLACK


def _metrics_answer(size: int) -> httpx.MockTransport:
    body = b'{"items": [], "next_since_step": null}'
    return httpx.MockTransport(lambda request: httpx.Response(200, content=body.ljust(size)))


def test_the_cap_is_inclusive() -> None:
    with LoraloomClient(
        "http://sdk.invalid", "llk_x", transport=_metrics_answer(100), max_response_bytes=100
    ) as c:
        assert c.get_metrics(RUN) == []
    with (
        LoraloomClient(
            "http://sdk.invalid", "llk_x", transport=_metrics_answer(101), max_response_bytes=100
        ) as c,
        pytest.raises(errors.ResponseTooLarge),
    ):
        c.get_metrics(RUN)


def test_an_adapter_download_over_its_cap_leaves_nothing(tmp_path: Path) -> None:
    def archive(server: RawServer, conn: socket.socket) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(10 * CAP // PIECE):
            server.body(conn, b"%x\r\n%s\r\n" % (PIECE, b"\0" * PIECE))

    with (
        RawServer(archive) as server,
        _sync(server.url, max_download_bytes=CAP) as client,
        pytest.raises(errors.ResponseTooLarge) as caught,
    ):
        client.fetch_adapter(RUN, "latest", tmp_path / "adapter")
    assert "max_download_bytes" in str(caught.value) and server.body_sent <= CAP + SLACK
    assert list(tmp_path.iterdir()) == []  # no destination, no temporary file


# ---- normal answers -------------------------------------------------------------------------------


def test_normal_answers_pass_under_tight_bounds(base_url: str, service: FakeService, tmp_path: Path) -> None:
    """Small JSON answers under a 64 KiB cap, and an adapter download five times that: downloads go
    to a file under their own cap, never to memory."""
    model = os.urandom(5 * 64 * 1024)
    with LoraloomClient(base_url, service.api_key, deadline=5.0, max_response_bytes=64 * 1024) as client:
        run = client.create_run("bounded", {})
        assert client.get_run(run.id).id == run.id
        service.add_adapter(run.id, 1, {"adapter_config.json": b"{}", "adapter_model.safetensors": model})
        got = client.fetch_adapter(run.id, "latest", tmp_path / "a")
        assert got.changed and (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == model
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


async def test_async_normal_answers_pass_under_tight_bounds(
    base_url: str, service: FakeService, tmp_path: Path
) -> None:
    model = os.urandom(5 * 64 * 1024)
    async with AsyncLoraloomClient(
        base_url, service.api_key, deadline=5.0, max_response_bytes=64 * 1024
    ) as client:
        run = await client.create_run("bounded-async", {})
        service.add_adapter(run.id, 1, {"adapter_config.json": b"{}", "adapter_model.safetensors": model})
        got = await client.fetch_adapter(run.id, 1, tmp_path / "a")
        assert (got.path / "adapter_model.safetensors").read_bytes() == model


# ---- the CLI's own requests (loraloom/commands/http.py) --------------------------------------------


def test_the_cli_request_is_bounded_too() -> None:
    with RawServer(trickle_headers) as server, ended_by_the_client(server), pytest.raises(CliError) as late:
        cli_request("GET", "/v1/runs", url=server.url, key="llk_x", deadline=1.0)
    assert late.value.kind == ExitCode.UNAVAILABLE and "deadline of 1s" in late.value.message

    def over_64_mib(server: RawServer, conn: socket.socket) -> None:  # the CLI's cap is the SDK's default
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (65 * 1024**2))
        for _ in range(10 * CAP // PIECE):
            server.body(conn, b" " * PIECE)

    with RawServer(over_64_mib) as server, pytest.raises(CliError) as large:
        cli_request("GET", "/v1/runs", url=server.url, key="llk_x")
    assert "max_response_bytes" in large.value.message and server.body_sent <= SLACK


def test_the_deadline_backend_is_installed() -> None:
    """The sync deadline on headers reaches into httpx's transport: an httpx upgrade that moves it
    fails here first (the header trickle test would hang until its per-read timeouts instead)."""
    from orchestrator.bounded import install_deadline

    with LoraloomClient("http://sdk.invalid", "llk_x") as client:
        assert install_deadline(client._http)


@pytest.mark.parametrize(
    "bad",
    [{"deadline": 0}, {"transfer_deadline": -1.0}, {"max_response_bytes": 0}, {"max_download_bytes": True}],
)
def test_bad_bounds_are_refused_at_construction(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        LoraloomClient("http://sdk.invalid", "llk_x", **bad)  # type: ignore[arg-type]


def test_error_text_names_the_limit() -> None:
    text = str(
        errors.ResponseTooLarge("GET http://h/v1/runs", 64 * 1024**2, "max_response_bytes", declared=10)
    )
    assert "64 MiB" in text and "10 bytes" in text and "GET http://h/v1/runs" in text
