"""A short-lived, per-process cache of API-key lookups (the ingest route's hot path skips a query).

Bound on revocation: a key revoked through this process stops working at once (the revoke route
clears the cache); revoked anywhere else (another worker process, another replica, the database
directly), it stops within `Settings.api_key_cache_seconds`. Only valid keys are cached, so a
wrong or revoked key is looked up every time.
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


def key_cache(state: State, ttl_s: float) -> ApiKeyCache:
    """The app's API-key cache."""
    cache: ApiKeyCache = state_cache(state, "api_key_cache", ttl_s)
    return cache
