"""Short-lived, per-process caches of API-key lookups: the valid keys (the ingest route's hot path,
and the request guard's credential check, skip a query) and the keys found unknown or revoked (a
client repeating a wrong key costs no query per request).

Bound on revocation: a key revoked through this process stops working at once (the revoke route
commits, then clears the cache of valid keys; a lookup that read the key before the clear does not
cache it after, `TtlCache.put`'s `read_in`); revoked anywhere else (another worker process, another replica,
the database directly), it stops within `Settings.api_key_cache_seconds`.

Bound on new keys: a key unknown when it was looked up is refused without a lookup for
`Settings.api_key_miss_cache_seconds` (1 s). Keys are made by the service, at random, so no client
tries one before it exists; only a key written into the database by hand after a client tried it
works that much later. Both caches are bounded (`TtlCache.MAX_ENTRIES`): made-up keys, each new,
are still one lookup each (README, "Hostile clients and limits": rate limits per client address
belong to the proxy in front).
"""

from dataclasses import dataclass

from starlette.datastructures import State

from app.ttl_cache import TtlCache, state_cache


@dataclass(frozen=True)
class CachedKey:
    tenant_id: str
    api_key_id: str


ApiKeyCache = TtlCache[str, CachedKey]
"""key hash → the key's tenant and id."""

KeyMissCache = TtlCache[str, bool]
"""key hash → True: no valid key has it (unknown or revoked)."""


def key_cache(state: State, ttl_s: float) -> ApiKeyCache:
    """The app's API-key cache."""
    cache: ApiKeyCache = state_cache(state, "api_key_cache", ttl_s)
    return cache


def key_miss_cache(state: State, ttl_s: float) -> KeyMissCache:
    """The app's cache of key hashes found unknown or revoked."""
    cache: KeyMissCache = state_cache(state, "api_key_miss_cache", ttl_s)
    return cache
