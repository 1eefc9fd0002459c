"""How the service is served: uvicorn with the httptools parser, a header-size limit answered with
a 431, and connection timeouts. One definition for `loraloom serve`, the service children of the
demo, tests and benchmarks (loraloom/launch.py), and the documented command line:

    uvicorn --factory app.main:create_app --http app.serving:LimitedHttpToolsProtocol \
        --timeout-keep-alive 5 --timeout-graceful-shutdown 10 --no-proxy-headers

httptools (llhttp, in C) rather than h11 (pure Python): h11 spent about a fifth of the service's
CPU on a 0.4 MB rollout batch (docs/benchmarks.md). But httptools has no limit on the size of
request headers (one 100 MB header stalled /healthz for every client for 21 s), so this protocol
counts the bytes of a request head as they arrive and answers a head that outgrows
MAX_HEADER_BYTES with a 431 in the uniform error body, closing the connection (malformed framing,
which uvicorn answers with a text/plain 400, gets the uniform body too). The count is per
read, so a head is refused at most one read (64 KiB) past the limit; a head that arrives whole in
one read is held to the exact limit by app/request_guard.py. `LimitedH11Protocol` (h11's own
limit, answered with a 431) stays available: `--http app.serving:LimitedH11Protocol
--h11-max-incomplete-event-size 16384`. Request *bodies* have their own limit and read deadline
in app/request_guard.py; the httptools protocol buffers up to BODY_HIGH_WATER_BYTES of a body
before it stops reading the socket.

uvicorn has no deadline for a request head: its only timer (the keep-alive timeout) runs from the
end of a response to the next byte, so a head sent in part and then left (300 of them, held 45 s
and more, used up a 512-descriptor service's connections) was held for ever. This protocol gives
every head `header_timeout_seconds` (the served app's settings; `LORALOOM_HEADER_TIMEOUT_SECONDS`),
from the connection's opening, and on a kept-alive connection from the next request's first byte
(idle until then, under uvicorn's own keep-alive timeout as before). A head not complete by then is
answered with a 408 in the uniform body and the connection closed; a connection on which nothing
arrived is closed without an answer, as an idle kept-alive one is.

uvicorn's X-Forwarded-* handling (its ProxyHeadersMiddleware, one more ASGI layer on every request)
is on only when `FORWARDED_ALLOW_IPS` (uvicorn's own variable: the proxies to trust) is set: the
service does not read the client's address, and without a proxy there is nothing to rewrite.

Shutdown (SIGTERM, Ctrl-C): uvicorn stops accepting connections and waited, with no bound, for every
open response to end; a live event stream lasts up to an hour, so `loraloom serve` hung as long as
any client watched a run. The protocols tell the app when the server starts its shutdown (their
`shutdown()`, which uvicorn calls on every connection first: app/shutdown.py), and the streams end
within a poll; `timeout_graceful_shutdown` (`LORALOOM_SHUTDOWN_TIMEOUT_SECONDS`, default 10 s)
bounds whatever else is still running.
"""

import asyncio
import json
import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.config import Settings
from app.shutdown import ShutdownNotice

MAX_HEADER_BYTES = 16 * 1024
"""Request line and headers together (h11's own default)."""

BODY_HIGH_WATER_BYTES = 1024 * 1024
"""Unread request body a connection buffers before the server stops reading its socket (uvicorn's
own mark is 64 KiB). The request guard reads every body whole into memory anyway (up to
`max_body_bytes`, app/request_guard.py), so pausing earlier bounds nothing; it only cost a 0.4 MB
rollout batch a second pause/resume round through the event loop and ~0.2-0.3 ms of service CPU
(docs/benchmarks.md, "Third push")."""

KEEP_ALIVE_SECONDS = 5

DEFAULT_HEADER_TIMEOUT_SECONDS: float = Settings.model_fields["header_timeout_seconds"].default
"""The head deadline of an app that has no loraloom settings (see `served_header_timeout`)."""

SHUTDOWN_TIMEOUT_ENV = "LORALOOM_SHUTDOWN_TIMEOUT_SECONDS"
_SHUTDOWN_TIMEOUT = Settings.model_fields["shutdown_timeout_seconds"]

PROXY_ALLOW_ENV = "FORWARDED_ALLOW_IPS"
"""Set (uvicorn reads it too): trust X-Forwarded-For/-Proto from these addresses."""


def proxy_headers_configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether a deployment asked for proxy headers (`env`: the service's environment)."""
    return bool((os.environ if env is None else env).get(PROXY_ALLOW_ENV, "").strip())


def shutdown_timeout_seconds(env: Mapping[str, str] | None = None) -> int:
    """The graceful-shutdown bound the service's settings give (`env`: the service's environment),
    checked as the settings check it: `loraloom serve` validated them already; a service child
    with a bad value would fail at start-up anyway, this says which variable before it starts."""
    raw = (os.environ if env is None else env).get(SHUTDOWN_TIMEOUT_ENV, "").strip()
    if not raw:
        return int(_SHUTDOWN_TIMEOUT.default)
    try:
        return TypeAdapter(Annotated[int, _SHUTDOWN_TIMEOUT]).validate_python(raw)
    except ValidationError as exc:
        problem = exc.errors()[0]["msg"]
        raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV}={raw!r}: {problem}") from None


def _write_error(transport: asyncio.Transport, status: str, code: str, message: str) -> None:
    """An error in the uniform body, written raw (the parser is mid-request), then close."""
    body = json.dumps({"error": {"code": code, "message": message, "details": None}}).encode()
    head = (
        f"HTTP/1.1 {status}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    transport.write(head.encode() + body)
    transport.close()


def _write_431(transport: asyncio.Transport, limit: int) -> None:
    message = f"request line and headers exceed {limit} bytes"
    _write_error(transport, "431 Request Header Fields Too Large", "request_header_fields_too_large", message)


def _write_400(transport: asyncio.Transport, parser_message: str) -> None:
    # uvicorn's own answer is text/plain; clients parse every error as the uniform body.
    message = f"malformed HTTP request: {parser_message}"
    _write_error(transport, "400 Bad Request", "bad_request", message)


def _write_408(transport: asyncio.Transport, seconds: float) -> None:
    message = f"the request line and headers did not arrive within {seconds:g} s"
    _write_error(transport, "408 Request Timeout", "request_timeout", message)


def _served_state(app: object) -> object | None:
    """The served app's `state` (where its settings are): uvicorn hands the protocol its loaded app,
    the service's FastAPI app, or that app inside uvicorn's own wrappers (proxy headers, trace
    logging), each holding the next as `.app`. None for an app without settings."""
    for _ in range(8):
        state = getattr(app, "state", None)
        if getattr(state, "settings", None) is not None:
            return state
        app = getattr(app, "app", None)
        if app is None:
            break
    return None


def served_header_timeout(app: object) -> float:
    """The served app's `header_timeout_seconds` (the service's settings)."""
    settings = getattr(_served_state(app), "settings", None)
    return float(getattr(settings, "header_timeout_seconds", DEFAULT_HEADER_TIMEOUT_SECONDS))


def announce_shutdown(app: object) -> None:
    """Tell the served app that the server begins its shutdown (its live streams then end)."""
    notice = getattr(_served_state(app), "shutdown", None)
    if isinstance(notice, ShutdownNotice):
        notice.begin()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering a request whose head grows past MAX_HEADER_BYTES with
    a 431, and one whose head is not complete within the head deadline with a 408.

    `_head_bytes` counts what arrives while a head is incomplete: from the connection's start or
    the end of the previous request to the end of this request's headers (the parser's callbacks
    mark both ends). The head timer runs from the connection's start, or from the read that brought
    the first bytes of a head (`on_message_begin`) while no request was being answered (before, the
    connection is idle: uvicorn's keep-alive timer), or, for a head that began while one was, from
    the end of that response; headers complete cancel it."""

    _in_head = True
    _head_bytes = 0
    _head_started = False
    """The parser has seen a byte of the current head."""
    _head_timer: asyncio.TimerHandle | None = None
    _head_timeout = DEFAULT_HEADER_TIMEOUT_SECONDS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timeout = served_header_timeout(self.app)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._in_head and self._head_bytes > MAX_HEADER_BYTES:
            self.logger.warning("request headers over %d bytes: 431", MAX_HEADER_BYTES)
            _write_431(self.transport, MAX_HEADER_BYTES)
        elif self._head_started and not self._answering():
            # A head began in this read and is not complete (a whole head, the usual case, never
            # arms the timer: no timer per request on a kept-alive connection).
            self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_started = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        # uvicorn's on_body (0.30-0.54) with BODY_HIGH_WATER_BYTES for its 64 KiB mark.
        if (self.parser.should_upgrade() and self._should_upgrade()) or self.cycle.response_complete:
            return
        self.cycle.body += body
        if len(self.cycle.body) > BODY_HIGH_WATER_BYTES:
            self.flow.pause_reading()
        self.cycle.message_event.set()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes = True, 0  # what follows is the next request's head

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A head that began arriving while this response was being sent has its deadline from now.
        if self._head_started and not self.transport.is_closing():
            self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        _write_400(self.transport, msg)

    def shutdown(self) -> None:
        # uvicorn's shutdown calls this on every connection before it waits for them to close.
        announce_shutdown(self.app)
        super().shutdown()

    def _answering(self) -> bool:
        """Whether a request whose head is complete is still being answered (or waits its turn)."""
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._answering():
            return  # closed already; or a response is on its way (its end re-arms the timer)
        if not self._head_started:
            self.transport.close()  # nothing arrived: closed without an answer, like an idle kept-alive one
            return
        self.logger.info("request head not complete within %g s: 408", self._head_timeout)
        _write_408(self.transport, self._head_timeout)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request whose headers are too large with a 431."""

    def send_400_response(self, msg: str) -> None:
        # h11 raised RemoteProtocolError; the only one with an unread buffer over the limit is
        # "Receive buffer too long" (its error_status_hint is 431).
        limit = self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES
        buffered, _closed = self.conn.trailing_data
        if len(buffered) <= limit:
            _write_400(self.transport, msg)
            return
        self.logger.warning("request headers over %d bytes: 431", limit)
        _write_431(self.transport, limit)

    def shutdown(self) -> None:
        announce_shutdown(self.app)  # as LimitedHttpToolsProtocol.shutdown
        super().shutdown()


def uvicorn_cli_args(env: Mapping[str, str] | None = None) -> list[str]:
    """The options of `uvicorn_options` as `uvicorn` command-line arguments (for a service started
    as a child process with the environment `env`, by default this one's)."""
    return [
        "--http",
        f"{LimitedHttpToolsProtocol.__module__}:{LimitedHttpToolsProtocol.__qualname__}",
        "--timeout-keep-alive",
        str(KEEP_ALIVE_SECONDS),
        "--timeout-graceful-shutdown",
        str(shutdown_timeout_seconds(env)),
        "--proxy-headers" if proxy_headers_configured(env) else "--no-proxy-headers",
    ]


def uvicorn_options(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The keyword arguments of uvicorn.Config (and uvicorn.run) every deployment uses."""
    return {
        "http": LimitedHttpToolsProtocol,
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
        "timeout_graceful_shutdown": shutdown_timeout_seconds(env),
        "proxy_headers": proxy_headers_configured(env),
    }
