"""A short-lived, per-process cache of API-key lookups (the ingest route's hot path skips a query).

Bound on revocation: a key revoked through this process stops working at once (the revoke route
clears the cache); revoked anywhere else (another worker process, another replica, the database
directly), it stops within `Settings.api_key_cache_seconds`. Only valid keys are cached, so a
wrong or revoked key is looked up every time. Held on `app.state` (no module globals).
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import State


@dataclass(frozen=True)
class CachedKey:
    tenant_id: str
    api_key_id: str
    expires_at: float


class ApiKeyCache:
    """key hash → (tenant, key id) for `ttl_s` seconds of `clock`. Thread-safe (sync routes run in a pool)."""

    MAX_ENTRIES = 10_000

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, CachedKey] = {}
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> CachedKey | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        if entry.expires_at <= self._clock():
            with self._lock:
                self._entries.pop(key_hash, None)
            return None
        return entry

    def put(self, key_hash: str, *, tenant_id: str, api_key_id: str) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.MAX_ENTRIES:
                self._entries.clear()  # crude, and rare: many distinct valid keys within one TTL
            self._entries[key_hash] = CachedKey(tenant_id, api_key_id, self._clock() + self.ttl_s)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def key_cache(state: State, ttl_s: float) -> ApiKeyCache:
    """The app's cache (made on first use, so every app, test apps included, has its own)."""
    cache: ApiKeyCache | None = getattr(state, "api_key_cache", None)
    if cache is None:
        cache = state.api_key_cache = ApiKeyCache(ttl_s)
    return cache
