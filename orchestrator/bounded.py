"""Bounded HTTP exchanges: a total deadline and a size cap on the answer, whatever the server does.

httpx's timeouts are per socket operation, so a server (or a man in the middle on plain HTTP) that
trickles a byte every few seconds keeps one request going forever; and `response.content` holds
whatever the server sends, gigabytes included. Every request of the SDK goes through `send` /
`send_async` instead, which return a response whose body is already read, within both bounds:

- Deadline: `deadline_s` for the whole exchange (connect, send, the complete answer). Async: one
  `asyncio.timeout` around it. Sync: each socket operation gets at most the time left (a network
  backend that `install_deadline` puts under the client's httpx transports), and the time is
  checked again at every chunk of the answer (which also covers transports without sockets, such
  as a test's MockTransport). Past it: `DeadlineExceeded`.
- Size: the answer is read chunk by chunk and refused (`ResponseTooLarge`) as soon as it passes
  `max_bytes`, or before a byte of it is read when its Content-Length says it would; memory holds
  at most `max_bytes` plus one chunk. With a `Sink`, a successful answer goes to a file instead
  (adapter downloads), under the sink's own cap; error answers stay in memory under `max_bytes`.

Both errors come from one attempt and are not retried (`contracts.http.send_with_retries` retries
only transport errors and 429/5xx): a server that overran them once would likely do it again, and
each retry would cost the whole deadline or the whole cap again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import IO, Any

import httpcore
import httpx

from orchestrator.errors import DeadlineExceeded, ResponseTooLarge

WRITE_PIECE = 64 * 1024
"""A send is split into pieces of this size, each given the time then left: a server that reads a
byte now and then would otherwise keep one large write (an upload) going past the deadline."""


@dataclass
class _Deadline:
    at: float
    hit: bool = False
    """Set when a socket operation timed out because the deadline cut it short."""


_CURRENT: ContextVar[_Deadline | None] = ContextVar("loraloom_http_deadline", default=None)


@dataclass(frozen=True)
class Sink:
    """Where a successful answer's body goes instead of memory, and how large it may be."""

    file: IO[bytes]
    max_bytes: int


def _clamp(timeout: float | None, expired: type[Exception]) -> float | None:
    """`timeout`, shortened to what is left of the current exchange's deadline (if any)."""
    current = _CURRENT.get()
    if current is None:
        return timeout
    left = current.at - time.monotonic()
    if left <= 0:
        current.hit = True
        raise expired("the request's total deadline has passed")
    return left if timeout is None or left < timeout else timeout


def _timed(operation: Any, timeout: float | None, expired: type[Exception]) -> Any:
    clamped = _clamp(timeout, expired)
    try:
        return operation(clamped)
    except httpcore.TimeoutException:
        current = _CURRENT.get()
        if current is not None and clamped != timeout:
            current.hit = True  # the deadline's share ran out, not the caller's own timeout
        raise


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data: bytes = _timed(lambda t: self._inner.read(max_bytes, t), timeout, httpcore.ReadTimeout)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        view = memoryview(buffer)
        for start in range(0, len(view), WRITE_PIECE):
            piece = view[start : start + WRITE_PIECE]
            _timed(lambda t, p=bytes(piece): self._inner.write(p, t), timeout, httpcore.WriteTimeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> Any:
        tls = _timed(
            lambda t: self._inner.start_tls(ssl_context, server_hostname, t), timeout, httpcore.ConnectTimeout
        )
        return _DeadlineStream(tls)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        stream = _timed(
            lambda t: self._inner.connect_tcp(host, port, t, local_address, socket_options),
            timeout,
            httpcore.ConnectTimeout,
        )
        return _DeadlineStream(stream)

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        stream = _timed(
            lambda t: self._inner.connect_unix_socket(path, t, socket_options),
            timeout,
            httpcore.ConnectTimeout,
        )
        return _DeadlineStream(stream)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def install_deadline(http: httpx.Client) -> bool:
    """Put the deadline-aware network backend under `http`'s transports (its own and those it mounts,
    e.g. for proxies from the environment); True if at least one took it. A transport that is not
    httpx's (a test's MockTransport) has no sockets: only the per-chunk check bounds it.

    httpx has no public hook for this, so it reaches into `transport._pool._network_backend`
    (httpx 0.27-0.28, httpcore 1.x); tests/orchestrator/test_client_bounds.py fails if that moves."""
    installed = False
    for transport in (http._transport, *http._mounts.values()):
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if isinstance(backend, _DeadlineBackend):
            installed = True
        elif isinstance(backend, httpcore.NetworkBackend):
            pool._network_backend = _DeadlineBackend(backend)  # type: ignore[union-attr]
            installed = True
    return installed


def _what(request: httpx.Request) -> str:
    return f"{request.method} {request.url}"


def _declared_length(response: httpx.Response) -> int | None:
    value = response.headers.get("content-length", "").strip()
    return int(value) if value.isdigit() else None


class _Body:
    """Takes the answer's chunks as they arrive, within the size cap and (sync) the deadline."""

    def __init__(
        self,
        response: httpx.Response,
        max_bytes: int,
        sink: Sink | None,
        deadline: float | None,
        limit_s: float,
    ) -> None:
        self.response = response
        self.sink = sink if sink is not None and response.is_success else None
        self.max_bytes = self.sink.max_bytes if self.sink is not None else max_bytes
        self.setting = "max_download_bytes" if self.sink is not None else "max_response_bytes"
        self.deadline, self.limit_s = deadline, limit_s
        self.size = 0
        self.chunks: list[bytes] = []
        declared = _declared_length(response)
        if declared is not None and declared > self.max_bytes:  # refused unread
            raise ResponseTooLarge(_what(response.request), self.max_bytes, self.setting, declared=declared)

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise ResponseTooLarge(_what(self.response.request), self.max_bytes, self.setting)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise DeadlineExceeded(_what(self.response.request), self.limit_s)
        if self.sink is not None:
            self.sink.file.write(chunk)
        else:
            self.chunks.append(chunk)

    def finish(self) -> httpx.Response:
        # What httpx's own `read()` stores, so `.content`, `.text` and `.json()` work as usual
        # (empty for an answer that went to the sink).
        self.response._content = b"".join(self.chunks)
        return self.response


def _rewind(sink: Sink | None) -> None:
    if sink is not None:  # a retry starts the file over
        sink.file.seek(0)
        sink.file.truncate()


def send(
    http: httpx.Client,
    request: httpx.Request,
    *,
    deadline_s: float | None,
    max_bytes: int,
    sink: Sink | None = None,
) -> httpx.Response:
    """Send `request` and read its answer whole, within `deadline_s` (None: no total deadline) and
    `max_bytes` (or the sink's cap); the response is closed, its body read (or in the sink)."""
    _rewind(sink)
    deadline = _Deadline(time.monotonic() + deadline_s) if deadline_s is not None else None
    token = _CURRENT.set(deadline)
    response: httpx.Response | None = None
    try:
        response = http.send(request, stream=True)
        body = _Body(response, max_bytes, sink, deadline.at if deadline else None, deadline_s or 0.0)
        for chunk in response.iter_bytes():
            body.add(chunk)
        return body.finish()
    except httpx.TransportError as exc:
        if (
            deadline_s is not None
            and deadline is not None
            and (deadline.hit or time.monotonic() >= deadline.at)
        ):
            raise DeadlineExceeded(_what(request), deadline_s) from exc
        raise  # an ordinary transport error: retried as before
    finally:
        _CURRENT.reset(token)
        if response is not None:
            response.close()


async def send_async(
    http: httpx.AsyncClient,
    request: httpx.Request,
    *,
    deadline_s: float | None,
    max_bytes: int,
    sink: Sink | None = None,
) -> httpx.Response:
    """The async twin of `send`: the deadline is one `asyncio.timeout` around the whole exchange."""
    _rewind(sink)
    response: httpx.Response | None = None
    try:
        async with asyncio.timeout(deadline_s):
            response = await http.send(request, stream=True)
            body = _Body(response, max_bytes, sink, None, deadline_s or 0.0)
            async for chunk in response.aiter_bytes():
                body.add(chunk)
            return body.finish()
    except TimeoutError as exc:  # asyncio.timeout's (httpx's own timeouts are httpx.TimeoutException)
        raise DeadlineExceeded(_what(request), deadline_s or 0.0) from exc
    finally:
        if response is not None:
            await response.aclose()
