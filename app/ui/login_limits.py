"""A bound on failed dashboard sign-ins, so that nobody can try API keys as fast as they can post.

Per client address, at most `ui_login_max_failures` failed sign-ins within the last
`ui_login_window_seconds` (a sliding window); past it the sign-in page answers 429 with Retry-After
for that address, without checking the key it was sent. Counted in memory, per service process
(with several uvicorn workers or replicas, each counts on its own: the bound is per process).

Which address: `request.client`, as the ASGI server reports it. The service reads X-Forwarded-For
only where a deployment trusts its proxies (`FORWARDED_ALLOW_IPS`, app/serving.py): then uvicorn's
proxy-headers layer has already put the forwarded client's address in `request.client`, and
otherwise the header is anyone's to write, so it is never read here. Behind a proxy that is not
named in `FORWARDED_ALLOW_IPS` every client shares the proxy's address, and so one bound: name the
proxy there. (The login CSRF check in app/ui/router.py may read X-Forwarded-Host, since there the
request is the victim's browser's; here the request is the guesser's own, headers and all.)
An IPv6 client counts by its /64 network: one host is usually handed a whole /64, and would
otherwise have 2**64 addresses to rotate through.

A successful sign-in clears nothing, not even its own address's failures: a tenant holding one
valid key could otherwise sign in between guesses and guess at any rate.
"""

import ipaddress
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from fastapi import Request

from app.config import Settings

log = logging.getLogger(__name__)

MAX_ADDRESSES = 10_000
"""Addresses remembered at once; past it the one whose last failure is oldest is forgotten, so an
attacker rotating addresses cannot grow the table (forgetting gives an address no more tries than
a fresh one has anyway). At most this many times `ui_login_max_failures` failure times are held."""


class LoginFailures:
    """Failed sign-ins per client address in a sliding window. Thread-safe: the sign-in route is
    sync, so it runs in a thread pool."""

    def __init__(
        self,
        *,
        max_failures: int,
        window_seconds: float,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_seconds = window_seconds
        self.max_addresses = max_addresses
        self._clock = clock
        # address → times of its latest failures (at most max_failures: older ones cannot matter),
        # ordered by each address's latest failure, oldest first.
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, address: str) -> int | None:
        """Seconds until `address` may try again, or None when it may try now."""
        with self._lock:
            now = self._clock()
            times = self._recent(address, now=now)
            if times is None or len(times) < self.max_failures:
                return None
            return max(1, math.ceil(times[0] + self.window_seconds - now))

    def admit(self, address: str) -> float | None:
        """A try for `address`, or None when it must wait (`retry_after` says how long). The try
        counts as a failure from now on, until `succeeded` takes it back: checking and recording in
        two steps let concurrent guesses all pass the check before any was recorded."""
        with self._lock:
            now = self._clock()
            times = self._recent(address, now=now)
            if times is not None and len(times) >= self.max_failures:
                return None
            self._add(address, times, now=now)
            return now

    def succeeded(self, address: str, attempt: float) -> None:
        """The try `admit` gave at `attempt` signed in: it is no failure (the others stay)."""
        with self._lock:
            times = self._failures.get(address)
            if times is not None and attempt in times:
                times.remove(attempt)
                if not times:
                    del self._failures[address]

    def _add(self, address: str, times: deque[float] | None, *, now: float) -> None:
        """One more failure of `address` at `now` (the lock is held)."""
        times = times if times is not None else deque(maxlen=self.max_failures)
        times.append(now)
        self._failures[address] = times
        self._failures.move_to_end(address)
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)
        if len(times) == self.max_failures:
            log.warning("dashboard sign-in: %s reached %s tries; refusing it for now", address, len(times))

    def addresses(self) -> int:
        """How many addresses are remembered (for tests of the bound)."""
        return len(self._failures)

    def _recent(self, address: str, *, now: float) -> deque[float] | None:
        """The address's failures still inside the window (the lock is held); forgets the rest."""
        times = self._failures.get(address)
        if times is None:
            return None
        while times and times[0] <= now - self.window_seconds:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times


def login_failures_for(settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> LoginFailures:
    return LoginFailures(
        max_failures=settings.ui_login_max_failures,
        window_seconds=settings.ui_login_window_seconds,
        clock=clock,
    )


def client_address(request: Request) -> str:
    """The address a sign-in counts against: the client's, an IPv6 one as its /64 network."""
    host = request.client.host if request.client is not None else ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host  # not an IP (a Unix socket, a test client): counted as given
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # an IPv4 client of a dual-stack socket
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)
