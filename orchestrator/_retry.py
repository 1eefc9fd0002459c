"""Retries with exponential backoff and full jitter, shared by the service client
and the OpenAI-compatible sampler.

The decision logic lives in `RetryState`; the sync and async drivers below only
differ in how they send and sleep.
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

import httpx

from orchestrator.errors import RetryExhausted, error_from_response

log = logging.getLogger(__name__)


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
    # A wrong URL scheme is a programming error, not a transient failure.
    return not isinstance(exc, httpx.UnsupportedProtocol)


class RetryState:
    """The retry decisions for one logical request, attempt after attempt."""

    def __init__(self, policy: RetryPolicy, what: str) -> None:
        self.policy = policy
        self.what = what
        self.attempt = 0
        self._rng = random.Random()

    def _next_delay(self, error: BaseException, retry_after: float | None) -> float:
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


def send_with_retries(send: Callable[[], httpx.Response], policy: RetryPolicy, what: str) -> httpx.Response:
    """Call `send` until it gives a final response; retryable failures are retried per `policy`."""
    state = RetryState(policy, what)
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
        time.sleep(delay)


async def send_with_retries_async(
    send: Callable[[], Awaitable[httpx.Response]], policy: RetryPolicy, what: str
) -> httpx.Response:
    """The async twin of `send_with_retries`."""
    state = RetryState(policy, what)
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
