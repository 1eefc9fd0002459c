"""Typed errors of the loraloom SDK: those of the service's answers are defined in `contracts.http`
(shared with the worker pool); the SDK's own bounds on an exchange (`orchestrator.bounded`) here."""

from contracts.http import (
    ApiError,
    BadRequest,
    Conflict,
    Forbidden,
    LoraloomError,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    RetryExhausted,
    RunEvicted,
    RunFailed,
    ServerError,
    Unauthorized,
    ValidationError,
    error_from_response,
)


def _size(n: int) -> str:
    return f"{n} bytes ({n / 1024**2:.4g} MiB)" if n >= 1024**2 else f"{n} bytes"


class DeadlineExceeded(ApiError):
    """One HTTP exchange (connect, send, the whole answer) outlasted the client's total deadline:
    the server is stalled, overloaded or trickling its answer. Not retried. `url` is the request
    (method and URL), `limit_s` the deadline it overran."""

    def __init__(self, url: str, limit_s: float) -> None:
        super().__init__(
            f"{url}: no complete answer within the client's deadline of {limit_s:g}s "
            "(raise it with the client's `deadline`, or `transfer_deadline` for adapter transfers)"
        )
        self.url = url
        self.limit_s = limit_s


class ResponseTooLarge(ApiError):
    """An answer was larger than the client accepts (refused unread when its Content-Length said so,
    else as soon as the bytes read passed the cap). Not retried. `url` is the request (method and
    URL), `limit_bytes` the cap, `setting` the client argument that sets it, `declared` the
    Content-Length when that is what refused it."""

    def __init__(self, url: str, limit_bytes: int, setting: str, *, declared: int | None = None) -> None:
        said = f"its Content-Length is {_size(declared)}" if declared is not None else "it kept coming"
        super().__init__(
            f"{url}: the answer is larger than the client's limit of {_size(limit_bytes)} ({said}); "
            f"raise the client's `{setting}` if it is expected"
        )
        self.url = url
        self.limit_bytes = limit_bytes
        self.setting = setting
        self.declared = declared


__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "DeadlineExceeded",
    "Forbidden",
    "LoraloomError",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "ResponseTooLarge",
    "RetryExhausted",
    "RunEvicted",
    "RunFailed",
    "ServerError",
    "Unauthorized",
    "ValidationError",
    "error_from_response",
]
