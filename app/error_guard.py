"""The outermost middleware: every response carries an X-Request-ID, and no exception leaves
the app as a text/plain 500 (which would also close the keep-alive connection).

- The database unreachable (connection refused or lost, pool exhausted) is a 503
  `database_unavailable` with Retry-After: the client's retry policy waits and tries again.
- A value the database refuses (sqlalchemy DataError: out of range, NUL character) is a 422.
  The routes check their input first and name the field; this is the net under them.
- Anything else is a 500 `internal_error`, logged with its traceback and the request id the
  response carries, so a report from a client can be matched to the log line.
"""

import logging
import uuid

from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import error_body

log = logging.getLogger("loraloom")

REQUEST_ID_HEADER = "X-Request-ID"
DB_RETRY_AFTER_SECONDS = 5


def is_database_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.TimeoutError | sa_exc.OperationalError | sa_exc.InterfaceError):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


class ErrorGuard:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.lower().encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:  # too late for an error body; let the server close the connection
                raise
            response = self._response_for(exc, scope, request_id)
            await response(scope, receive, send_with_id)

    @staticmethod
    def _response_for(exc: Exception, scope: Scope, request_id: str) -> JSONResponse:
        where = f"{scope.get('method')} {scope.get('path')}"
        if is_database_unavailable(exc):
            log.warning("request %s (%s): database unavailable: %s", request_id, where, type(exc).__name__)
            return JSONResponse(
                error_body("database_unavailable", "the database is unavailable; retry later"),
                status_code=503,
                headers={"Retry-After": str(DB_RETRY_AFTER_SECONDS)},
            )
        if isinstance(exc, sa_exc.DataError):
            log.info("request %s (%s): value refused by the database: %s", request_id, where, exc.orig)
            return JSONResponse(
                error_body("validation_error", "a value is out of the range the service stores", []),
                status_code=422,
            )
        log.exception("request %s (%s): unhandled error", request_id, where)
        return JSONResponse(
            error_body(
                "internal_error", f"internal error; request id {request_id}", {"request_id": request_id}
            ),
            status_code=500,
        )
