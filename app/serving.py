"""How the service is served: uvicorn with the h11 protocol, a header-size limit answered with a
431, and connection timeouts. One definition for `loraloom serve`, the tests and the documented
command line:

    uvicorn --factory app.main:create_app --http app.serving:LimitedH11Protocol \
        --h11-max-incomplete-event-size 16384 --timeout-keep-alive 5

h11 rather than httptools: httptools has no limit on the size of request headers (one 100 MB
header stalled /healthz for every client for 21 s). h11 refuses a request whose headers outgrow
`h11_max_incomplete_event_size`; uvicorn answers that with a plain 400, this protocol with a 431
in the uniform error body. Request *bodies* have their own limit and read deadline in
app/request_guard.py.
"""

import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 16 * 1024
"""Request line and headers together (h11's own default)."""

KEEP_ALIVE_SECONDS = 5


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request whose headers are too large with a 431."""

    def send_400_response(self, msg: str) -> None:
        # h11 raised RemoteProtocolError; the only one with an unread buffer over the limit is
        # "Receive buffer too long" (its error_status_hint is 431).
        limit = self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES
        buffered, _closed = self.conn.trailing_data
        if len(buffered) <= limit:
            super().send_400_response(msg)
            return
        self.logger.warning("request headers over %d bytes: 431", limit)
        error = {
            "code": "request_header_fields_too_large",
            "message": f"request line and headers exceed {limit} bytes",
            "details": None,
        }
        body = json.dumps({"error": error}).encode()
        # Written raw: the h11 connection is in its ERROR state and sends nothing more.
        head = (
            "HTTP/1.1 431 Request Header Fields Too Large\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def uvicorn_cli_args() -> list[str]:
    """The same options as `uvicorn` command-line arguments (for a service started as a child process)."""
    return [
        "--http",
        f"{LimitedH11Protocol.__module__}:{LimitedH11Protocol.__qualname__}",
        "--h11-max-incomplete-event-size",
        str(MAX_HEADER_BYTES),
        "--timeout-keep-alive",
        str(KEEP_ALIVE_SECONDS),
    ]


def uvicorn_options() -> dict[str, Any]:
    """The keyword arguments of uvicorn.Config (and uvicorn.run) every deployment uses."""
    return {
        "http": LimitedH11Protocol,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "timeout_keep_alive": KEEP_ALIVE_SECONDS,
    }
