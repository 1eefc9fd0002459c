"""The error guard (applied by app/front.py, outside the routes and their handlers): every response
carries an X-Request-ID, and no exception leaves the app as a text/plain 500 (which would also
close the keep-alive connection).

- The database unreachable (connection refused or lost, pool exhausted) is a 503
  `database_unavailable` with Retry-After: the client's retry policy waits and tries again.
- A value the database refuses (sqlalchemy DataError: out of range, NUL character) is a 422.
  The routes check their input first and name the field; this is the net under them.
- Anything else is a 500 `internal_error`, logged with its traceback and the request id the
  response carries, so a report from a client can be matched to the log line.
"""

import logging

from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.types import Scope

from app.errors import error_body, problem

log = logging.getLogger("loraloom")

REQUEST_ID_HEADER = "X-Request-ID"
DB_RETRY_AFTER_SECONDS = 5
_OUT_OF_RANGE = "a value is out of the range the service stores"


def is_database_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.TimeoutError | sa_exc.OperationalError | sa_exc.InterfaceError):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


def error_response(exc: Exception, scope: Scope, request_id: str) -> JSONResponse:
    """The uniform answer to an exception no route handled (request `request_id`), logged."""
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
            error_body("validation_error", _OUT_OF_RANGE, [problem(("body",), _OUT_OF_RANGE)]),
            status_code=422,
        )
    log.exception("request %s (%s): unhandled error", request_id, where)
    return JSONResponse(
        error_body("internal_error", f"internal error; request id {request_id}", {"request_id": request_id}),
        status_code=500,
    )
