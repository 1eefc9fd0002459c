"""A small per-process cache whose entries expire: what a hot route looked up in the database,
trusted for a stated number of seconds (the API-key cache, app/key_cache.py; the runs the batch
route reads, app/batches/ingest_run.py). Held on `app.state` (no module globals), so every app,
test apps included, has its own."""

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from starlette.datastructures import State

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class TtlCache(Generic[K, V]):
    """key → value for `ttl_s` seconds of `clock` (0: nothing is kept). Thread-safe: sync routes
    run in a thread pool."""

    MAX_ENTRIES = 10_000

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[K, tuple[V, float]] = {}
        self._lock = threading.Lock()
        self.generation = 0
        """Bumped by `clear`: a value read from the database before a clear may be stale."""

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        value, expires_at = entry
        if expires_at <= self._clock():
            self.pop(key)
            return None
        return value

    def put(self, key: K, value: V, *, read_in: int | None = None) -> None:
        """Keep `value` for `key`; with `read_in` (the `generation` before the value was read), not
        if the cache was cleared since: the value may predate what the clear was for (a revoked key
        read as valid by a request racing the revocation would be trusted for a whole TTL)."""
        if self.ttl_s <= 0:
            return
        with self._lock:
            if read_in is not None and read_in != self.generation:
                return
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()  # crude, and rare: that many distinct entries within one TTL
            self._entries[key] = (value, self._clock() + self.ttl_s)

    def pop(self, key: K) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.generation += 1


def state_cache(state: State, name: str, ttl_s: float) -> Any:
    """The app's cache called `name` (made on first use with `ttl_s`)."""
    cache: TtlCache[Any, Any] | None = getattr(state, name, None)
    if cache is None:
        cache = TtlCache(ttl_s)
        setattr(state, name, cache)
    return cache
