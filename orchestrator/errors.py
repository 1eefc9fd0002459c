"""Typed errors of the loraloom SDK (defined in `contracts.http`, shared with the worker pool)."""

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

__all__ = [
    "ApiError",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "LoraloomError",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RetryExhausted",
    "RunEvicted",
    "RunFailed",
    "ServerError",
    "Unauthorized",
    "ValidationError",
    "error_from_response",
]
