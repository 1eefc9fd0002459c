"""Domain errors. Services raise these; one handler in main.py turns them into
`{"error": {"code", "message", "details"}}` responses."""

from typing import Any


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    """The one error body every 4xx/5xx carries."""
    return {"error": {"code": code, "message": message, "details": details}}


class AppError(Exception):
    status: int = 400
    code: str = "bad_request"

    def __init__(self, message: str, *, details: Any = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        if code is not None:
            self.code = code


class ValidationFailed(AppError):
    status = 422
    code = "validation_error"


class Unauthorized(AppError):
    status = 401
    code = "unauthorized"


class Forbidden(AppError):
    status = 403
    code = "forbidden"


class NotFound(AppError):
    status = 404
    code = "not_found"


class Conflict(AppError):
    status = 409
    code = "conflict"


class PayloadTooLarge(AppError):
    status = 413
    code = "payload_too_large"


class UnsupportedMediaType(AppError):
    status = 415
    code = "unsupported_media_type"


class ServiceUnavailable(AppError):
    status = 503
    code = "unavailable"


class RateLimited(AppError):
    """429; the response carries Retry-After."""

    status = 429
    code = "rate_limited"

    def __init__(self, message: str, *, details: Any = None, retry_after: int = 1) -> None:
        super().__init__(message, details=details)
        self.retry_after = retry_after
