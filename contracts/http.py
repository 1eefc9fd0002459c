"""HTTP between the parts: the uniform error body as typed exceptions, and the retry policy.

Every error the service returns has the body `{"error": {"code", "message", "details"}}`;
`error_from_response` turns it into one of the classes below, so callers can
`except NotFound` instead of inspecting status codes. The SDK and the worker pool's
client both use these, and `send_with_retries` (exponential backoff with full jitter;
connection errors, 429 with Retry-After and 5xx retried, every other 4xx an answer; a caller that is
stopping, e.g. the worker pool after a Ctrl-C, gets no retries and no backoff: `RetryStopped`).
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpx

log = logging.getLogger(__name__)


class LoraloomError(Exception):
    """Base of everything the SDK raises on purpose."""


class ApiError(LoraloomError):
    """An error answer of the service (or a failure to get any answer: see `RetryExhausted`)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        details: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        """HTTP status of the answer; None when no answer came (connection errors) or the SDK raised it."""
        self.code = code
        """The server's machine-readable error code, e.g. `not_found`."""
        self.details = details
        """The server's `details` (field errors for a 422, the eviction reason for a 409, ...)."""

    def __str__(self) -> str:
        prefix = f"{self.status} " if self.status is not None else ""
        code = f"[{self.code}] " if self.code else ""
        return f"{prefix}{code}{self.message}{_field_problems(self.details)}"


def _field_problems(details: Any, most: int = 5) -> str:
    """The field errors of a 422 as text to append to its message, which only counts them ("2 invalid
    field(s)"): `: body.config.lora.rank: Input should be ...; ...`, so a traceback says which field."""
    if not isinstance(details, list):
        return ""
    problems = [
        f"{'.'.join(str(p) for p in d['loc'])}: {d['msg']}"
        for d in details
        if isinstance(d, dict) and isinstance(d.get("loc"), list) and isinstance(d.get("msg"), str)
    ]
    if not problems:
        return ""
    more = f"; and {len(problems) - most} more" if len(problems) > most else ""
    return ": " + "; ".join(problems[:most]) + more


class BadRequest(ApiError):
    """400 and the other 4xx without a class of their own."""


class Unauthorized(ApiError):
    """401: no API key, or a revoked one."""


class Forbidden(ApiError):
    """403: the key may not use this route (e.g. a tenant key on an admin route)."""


class NotFound(ApiError):
    """404: the object does not exist, or belongs to another tenant."""


class Conflict(ApiError):
    """409: the request conflicts with the object's state (e.g. the run is not active)."""


class RunEvicted(Conflict):
    """The run was evicted; the rollout loop must stop.

    Raised for a 409 whose code says the run is evicted, and by SDK helpers that
    see a run with status `evicted`."""

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        reason: str | None = None,
        evicted_by: str | None = None,
        status: int | None = None,
        code: str | None = "run_evicted",
        details: Any = None,
    ) -> None:
        super().__init__(message, status=status, code=code, details=details)
        self.run_id = run_id
        self.reason = reason
        """Why the run was evicted, as the evicting party wrote it."""
        self.evicted_by = evicted_by
        """`user`, `trainer`, `orchestrator` or `heartbeat`."""


class RunFailed(Conflict):
    """The run ended without being evicted and cannot take batches (`failed`, `deleted`; also
    `completed`, for a caller waiting for the run to become active)."""

    def __init__(self, message: str, *, run_id: str | None = None, run_status: str | None = None) -> None:
        super().__init__(message, code="run_not_active")
        self.run_id = run_id
        self.run_status = run_status


class ValidationError(ApiError):
    """422: the request body was rejected; `details` lists every problem."""


class PayloadTooLarge(ApiError):
    """413: the body is over the service's limit."""


class ServerError(ApiError):
    """5xx. Retried by the client; seen by callers only inside `RetryExhausted`."""


class RateLimited(ApiError):
    """429. Retried by the client; seen by callers only inside `RetryExhausted`."""


class RetryExhausted(ApiError):
    """Every attempt of one logical request failed with a retryable error.

    `last_error` is the last attempt's exception (a `ServerError`, `RateLimited`
    or an `httpx.TransportError`)."""

    def __init__(self, message: str, *, attempts: int, last_error: BaseException) -> None:
        status = last_error.status if isinstance(last_error, ApiError) else None
        code = last_error.code if isinstance(last_error, ApiError) else None
        details = last_error.details if isinstance(last_error, ApiError) else None
        super().__init__(message, status=status, code=code, details=details)
        self.attempts = attempts
        self.last_error = last_error


class RetryStopped(RetryExhausted):
    """A retryable failure not retried because the caller is stopping (`send_with_retries(stop=...)`).

    A `RetryExhausted` given up early: the worker pool stopped by Ctrl-C while the service was down
    retried its state sync for about a minute and then died on `RetryExhausted`'s traceback."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: ValidationError,
    429: RateLimited,
}


def _is_eviction(code: str | None) -> bool:
    # The service says `run_evicted` (with details {reason, evicted_by}); any code naming an
    # eviction counts. Other 409s about an evicted run (e.g. `invalid_transition` when evicting
    # it twice) stay plain Conflicts: their message is not an eviction reason.
    return code is not None and "evict" in code.lower()


def error_from_response(response: httpx.Response) -> ApiError:
    """The typed exception for an error response (status >= 400)."""
    status = response.status_code
    code: str | None = None
    message = response.reason_phrase or f"HTTP {status}"
    details: Any = None
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        code = err.get("code") if isinstance(err.get("code"), str) else None
        message = str(err.get("message") or message)
        details = err.get("details")
    elif isinstance(body, dict) and "detail" in body:
        # FastAPI's default shape, in case a route escapes the service's error handler.
        details = body["detail"]
        message = details if isinstance(details, str) else message
    elif response.text:
        message = response.text[:500]

    if status == 409 and _is_eviction(code):
        info = details if isinstance(details, dict) else {}
        return RunEvicted(
            message,
            run_id=info.get("run_id"),
            reason=info.get("reason") or info.get("eviction_reason") or message,
            evicted_by=info.get("evicted_by"),
            status=status,
            code=code,
            details=details,
        )
    if status >= 500:
        cls: type[ApiError] = ServerError
    else:
        cls = _BY_STATUS.get(status, BadRequest)
    return cls(message, status=status, code=code, details=details)


def api_prefix_problem(base_url: str) -> str | None:
    """Why `base_url` is no base URL of the service, else None: ending in /api/v1 it names the
    Tinker SDK's surface (which wants X-API-Key: each call answered 401, read as a wrong key); ending
    in /v1 it repeats the prefix every route already starts with (each call answered 404). The SDK and
    the CLI refuse it in these words. A URL ending in /api alone is not refused (a reverse proxy may
    serve the service there): a 401 there says what it likely is (`tinker_surface_hint`)."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    lowered = path.lower()
    if lowered.endswith("/api/v1"):  # before /v1: it must not suggest ".../api"
        fixed = parts._replace(path=path[: -len("/api/v1")]).geturl()
        return (
            f"{base_url!r} ends with /api/v1, the Tinker SDK's API: give the service's base URL, "
            f"e.g. {fixed!r}"
        )
    if not lowered.endswith("/v1"):
        return None
    fixed = parts._replace(path=path[:-3]).geturl()
    return f"{base_url!r} ends with /v1: give the base URL without /v1, e.g. {fixed!r}"


def tinker_surface_hint(base_url: str) -> str | None:
    """What a 401 most likely means at a base URL ending in /api, else None: /api/v1 is where the
    Tinker SDK's API lives, which wants X-API-Key, so every call with a Bearer key is refused."""
    parts = urlsplit(base_url)
    path = parts.path.rstrip("/")
    if not path.lower().endswith("/api"):
        return None
    fixed = parts._replace(path=path[: -len("/api")]).geturl()
    return (
        f"{base_url!r} ends with /api, where the Tinker SDK's API lives: unless a proxy serves this "
        f"service there, give its base URL, e.g. {fixed!r}"
    )


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long to retry one logical request."""

    max_attempts: int = 5
    """Attempts in all, the first included (1 = never retry)."""
    backoff_base_s: float = 0.25
    """The n-th retry waits uniform(0, min(backoff_max_s, backoff_base_s * 2**(n-1)))."""
    backoff_max_s: float = 10.0
    max_retry_after_s: float = 60.0
    """A server's Retry-After is honoured up to this many seconds."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("backoff times must be >= 0")

    @staticmethod
    def retryable_status(status: int) -> bool:
        # 429 and 5xx are transient by definition; every other 4xx would fail again the same way.
        return status == 429 or status >= 500


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


def _retryable_exception(exc: httpx.TransportError) -> bool:
    # A wrong URL scheme, or a request httpx refuses to put on the wire (LocalProtocolError: e.g. a
    # header value with a line end, an API key read from a file), is the caller's own mistake: each
    # attempt fails the same way, nothing transient to wait out.
    return not isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError)


STOP_POLL_S = 0.1
"""How often a backoff pause asks its `stop` whether the caller is stopping."""


class RetryState:
    """The retry decisions for one logical request, attempt after attempt."""

    def __init__(self, policy: RetryPolicy, what: str, stop: Callable[[], bool] | None = None) -> None:
        self.policy = policy
        self.what = what
        self.attempt = 0
        self.stop = stop
        """True once the caller is stopping: a failed attempt is then not retried (`RetryStopped`)."""
        self.last_error: BaseException | None = None
        self._rng = random.Random()

    def _stopped(self, error: BaseException) -> RetryStopped:
        return RetryStopped(
            f"{self.what}: not retried after attempt {self.attempt}, stopping: {error}",
            attempts=self.attempt,
            last_error=error,
        )

    def pause(self, delay: float) -> None:
        """Sleep `delay` seconds before the next attempt; raise `RetryStopped` (from the failed
        attempt's error) as soon as `stop` says the caller is stopping.

        `stop` is polled every STOP_POLL_S rather than a threading.Event waited on: the worker pool's
        flag is set by its signal handler, and a handler that sets an Event can deadlock on the Event's
        own lock when the signal lands while this thread holds it (inside Event.wait)."""
        if self.stop is None:
            time.sleep(delay)
            return
        end = time.monotonic() + delay
        while not self.stop():
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, STOP_POLL_S))
        error = self.last_error
        assert error is not None  # a pause follows a failed attempt (`_next_delay`)
        raise self._stopped(error) from error

    def _next_delay(self, error: BaseException, retry_after: float | None) -> float:
        self.last_error = error
        if self.stop is not None and self.stop():
            raise self._stopped(error) from error  # one attempt while stopping: no retry, no backoff
        if self.attempt >= self.policy.max_attempts:
            raise RetryExhausted(
                f"{self.what}: gave up after {self.attempt} attempts: {error}",
                attempts=self.attempt,
                last_error=error,
            ) from error
        if retry_after is not None:
            delay = min(retry_after, self.policy.max_retry_after_s)
        else:
            cap = min(self.policy.backoff_max_s, self.policy.backoff_base_s * 2 ** (self.attempt - 1))
            delay = self._rng.uniform(0.0, cap)
        log.warning(
            "%s: attempt %d/%d failed (%s); retrying in %.2fs",
            self.what,
            self.attempt,
            self.policy.max_attempts,
            error,
            delay,
        )
        return delay

    def start_attempt(self) -> None:
        self.attempt += 1

    def on_response(self, response: httpx.Response) -> float | None:
        """None when `response` is final (success or a non-retryable error), else the delay before retrying."""
        if not RetryPolicy.retryable_status(response.status_code):
            return None
        error = error_from_response(response)
        return self._next_delay(error, parse_retry_after(response.headers.get("retry-after")))

    def on_exception(self, exc: httpx.TransportError) -> float:
        if not _retryable_exception(exc):
            raise exc
        return self._next_delay(exc, None)


def send_with_retries(
    send: Callable[[], httpx.Response],
    policy: RetryPolicy,
    what: str,
    stop: Callable[[], bool] | None = None,
) -> httpx.Response:
    """Call `send` until it gives a final response; retryable failures are retried per `policy`.

    `stop`: True once the caller is stopping. From then on a retryable failure raises `RetryStopped`
    at once, and a backoff pause under way ends within STOP_POLL_S with it; an attempt still gets
    its answer (a stopping worker pool still reports to a service that is up)."""
    state = RetryState(policy, what, stop)
    delay: float | None
    while True:
        state.start_attempt()
        try:
            response = send()
        except httpx.TransportError as exc:
            delay = state.on_exception(exc)
        else:
            delay = state.on_response(response)
            if delay is None:
                return response
            response.close()
        state.pause(delay)


async def send_with_retries_async(
    send: Callable[[], Awaitable[httpx.Response]], policy: RetryPolicy, what: str
) -> httpx.Response:
    """The async twin of `send_with_retries`."""
    state = RetryState(policy, what)
    delay: float | None
    while True:
        state.start_attempt()
        try:
            response = await send()
        except httpx.TransportError as exc:
            delay = state.on_exception(exc)
        else:
            delay = state.on_response(response)
            if delay is None:
                return response
            await response.aclose()
        await asyncio.sleep(delay)
