"""Domain errors. Services raise these; one handler in main.py turns them into
`{"error": {"code", "message", "details"}}` responses.

Each class names its HTTP status, its default `code` and every other code it is raised with
(`codes`): the OpenAPI document's `Error.code` enum and each operation's error responses are
generated from these classes (app/openapi.py), and a test checks that every `code=` in the
source is listed here. `raises(...)` marks a route or a dependency with the errors it can raise.
"""

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    """The one error body every 4xx/5xx carries."""
    return {"error": {"code": code, "message": message, "details": details}}


def problem(loc: Sequence[str | int], msg: str, kind: str = "value_error") -> dict[str, Any]:
    """One item of a 422's `details` (README "Errors"): `loc` the path of the field at fault, its
    parts strings as pydantic's are written (`["data", "3", "model_input"]`), `msg` what is wrong
    with it, `type` a machine-readable name of the problem (pydantic's where one fits)."""
    return {"loc": [str(part) for part in loc], "msg": msg, "type": kind}


class AppError(Exception):
    status: int = 400
    code: str = "bad_request"
    codes: tuple[str, ...] = ("http_error",)
    """The other codes raised with this status (besides `code`)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "codes" not in cls.__dict__:
            cls.codes = ()  # a subclass's other codes are its own, never its parent's

    def __init__(self, message: str, *, details: Any = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if details is None and self.status == 422:
            # Every 422 lists its problems (README "Errors"): one raised without any names the body
            # as a whole rather than answering `details: null` (a Tinker sample's did).
            details = [problem(("body",), message)]
        self.details = details
        if code is not None:
            self.code = code

    @property
    def headers(self) -> dict[str, str] | None:
        """Response headers this error's status calls for (app/main.py's handler sends them)."""
        return None


class ValidationFailed(AppError):
    status = 422
    code = "validation_error"
    codes = ("invalid_adapter", "no_pool")


class Unauthorized(AppError):
    """401. `challenge`: the `WWW-Authenticate` value the response carries (RFC 9110 §15.5.2: a 401
    names how to authenticate); the Bearer routes set it (app/auth.py), the dashboard's sign-in and
    the Tinker API's X-API-Key (no HTTP authentication scheme) leave it None."""

    status = 401
    code = "unauthorized"
    codes = ()

    def __init__(
        self, message: str, *, details: Any = None, code: str | None = None, challenge: str | None = None
    ) -> None:
        super().__init__(message, details=details, code=code)
        self.challenge = challenge

    @property
    def headers(self) -> dict[str, str] | None:
        return None if self.challenge is None else {"WWW-Authenticate": self.challenge}


class Forbidden(AppError):
    status = 403
    code = "forbidden"
    codes = ("csrf_failed", "not_confirmed")  # the dashboard's form posts (app/ui)


class NotFound(AppError):
    status = 404
    code = "not_found"
    codes = ("adapter_not_found", "pool_not_found", "checkpoint_not_found")


class MethodNotAllowed(AppError):
    status = 405
    code = "method_not_allowed"
    codes = ()


class Conflict(AppError):
    status = 409
    code = "conflict"
    codes = (
        "idempotency_conflict",
        "invalid_transition",
        "run_evicted",
        "run_not_active",
        "stale_batch",
        "ack_rejected",
        "run_not_trainable",
        "pool_dead",
        "pool_stopped",
        "adapter_quota",
    )


class PayloadTooLarge(AppError):
    status = 413
    code = "payload_too_large"
    codes = ()


class RangeNotSatisfiable(AppError):
    """416: a download's `Range` starts past the end of the file (app/adapters/file_response.py
    answers it while sending; the class lists it in the document)."""

    status = 416
    code = "range_not_satisfiable"
    codes = ()


class UnsupportedMediaType(AppError):
    status = 415
    code = "unsupported_media_type"
    codes = ()


class ServiceUnavailable(AppError):
    status = 503
    code = "unavailable"
    codes = ("database_unavailable", "schema_not_current")


class RequestTimeout(AppError):
    """408: the request body did not arrive in time (app/request_guard.py)."""

    status = 408
    code = "request_timeout"
    codes = ()


class HeaderTooLarge(AppError):
    """431: request line and headers over the limit (app/serving.py, app/request_guard.py)."""

    status = 431
    code = "request_header_fields_too_large"
    codes = ()


class InternalError(AppError):
    """500: anything unforeseen, answered by app/error_guard.py with a request id."""

    status = 500
    code = "internal_error"
    codes = ()


class RateLimited(AppError):
    """429; the response carries Retry-After."""

    status = 429
    code = "rate_limited"

    def __init__(self, message: str, *, details: Any = None, retry_after: int = 1) -> None:
        super().__init__(message, details=details)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after)}


def error_classes() -> list[type[AppError]]:
    """AppError and every subclass, defined here or anywhere else."""
    found: list[type[AppError]] = []
    pending: list[type[AppError]] = [AppError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def all_codes() -> list[str]:
    """Every code the service can answer with, sorted (the `Error.code` enum)."""
    return sorted({c for cls in error_classes() for c in (cls.code, *cls.codes)})


def raises(*errors: type[AppError]) -> Callable[[_F], _F]:
    """Mark a route handler or a dependency with the errors it can raise, for the OpenAPI document."""

    def mark(fn: _F) -> _F:
        previous: tuple[type[AppError], ...] = getattr(fn, "__raises__", ())
        fn.__raises__ = (*previous, *errors)  # type: ignore[attr-defined]
        return fn

    return mark
