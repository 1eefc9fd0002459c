"""`send_with_retries(stop=...)`: a caller that is stopping gets no retries and no backoff.

The worker pool stopped by Ctrl-C while the service was down retried its state sync 24 times
(about a minute) and then died on RetryExhausted's traceback. The module's clock is a fake here
whose `sleep` records the pause asked for and moves the time on, so each test is exact about
which pauses were asked for (and neither sleeps nor hangs on one).
"""

import httpx
import pytest

from contracts import http
from contracts.http import RetryExhausted, RetryPolicy, RetryStopped, send_with_retries

REQUEST = httpx.Request("GET", "http://127.0.0.1:9/v1/pool/state")
POLICY = RetryPolicy(max_attempts=24, backoff_base_s=5.0, backoff_max_s=5.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    clock = FakeClock()
    monkeypatch.setattr(http, "time", clock)
    return clock.sleeps


class Sender:
    """Refuses the connection `failures` times, then answers 200."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self) -> httpx.Response:
        self.calls += 1
        if self.calls <= self.failures:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=REQUEST)
        return httpx.Response(200, request=REQUEST)


def test_a_stopping_caller_gets_one_attempt_and_no_pause(sleeps: list[float]) -> None:
    send = Sender(failures=100)
    with pytest.raises(RetryStopped) as stopped:
        send_with_retries(send, POLICY, "GET /v1/pool/state", stop=lambda: True)
    assert send.calls == 1 and sleeps == []
    assert isinstance(stopped.value, RetryExhausted)  # callers that catch a give-up catch this one
    assert isinstance(stopped.value.last_error, httpx.ConnectError)
    assert str(stopped.value) == (
        "GET /v1/pool/state: not retried after attempt 1, stopping: [Errno 111] Connection refused"
    )


def test_a_stop_during_a_backoff_pause_ends_it_at_the_next_poll(sleeps: list[float]) -> None:
    checks = iter([False, False, False, True])  # the stop comes at the fourth look
    calls = []

    def send() -> httpx.Response:  # a pause of exactly 3 s (the backoff's would be random)
        calls.append(1)
        return httpx.Response(503, headers={"Retry-After": "3"}, request=REQUEST)

    with pytest.raises(RetryStopped) as stopped:
        send_with_retries(send, POLICY, "GET /v1/pool/state", stop=lambda: next(checks))
    # The failure's own look (False) let the 3 s pause begin; it slept in slices, two of them,
    # and ended at its next look instead of sleeping out the 3 s and retrying.
    assert len(calls) == 1 and stopped.value.status == 503
    assert sleeps == [http.STOP_POLL_S, http.STOP_POLL_S]


def test_a_stopping_caller_still_gets_an_answer(sleeps: list[float]) -> None:
    """A service that is up answers a stopping pool (its last reports, its deregistration)."""
    response = send_with_retries(Sender(failures=0), POLICY, "GET /v1/pool/state", stop=lambda: True)
    assert response.status_code == 200 and sleeps == []


def test_a_5xx_while_stopping_is_not_retried_and_keeps_its_status(sleeps: list[float]) -> None:
    calls = []

    def send() -> httpx.Response:
        calls.append(1)
        return httpx.Response(
            503, json={"error": {"code": "unavailable", "message": "db down"}}, request=REQUEST
        )

    with pytest.raises(RetryStopped) as stopped:
        send_with_retries(send, POLICY, "POST /v1/pool/batches/claim", stop=lambda: True)
    assert len(calls) == 1 and sleeps == []
    assert stopped.value.status == 503 and stopped.value.code == "unavailable"


def test_without_a_stop_the_retries_are_unchanged(sleeps: list[float]) -> None:
    send = Sender(failures=3)
    assert send_with_retries(send, POLICY, "GET /v1/pool/state", stop=lambda: False).status_code == 200
    assert send.calls == 4
    # Three pauses, each slept in slices adding up to its backoff: the polls change nothing else.
    assert len(sleeps) >= 3 and all(0 < s <= http.STOP_POLL_S for s in sleeps)
