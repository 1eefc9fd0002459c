"""Who is calling: a tenant (API key), the admin (admin key) or a worker pool (worker token).

Keys are high-entropy random strings, so a plain sha256 is the right hash: it makes the
stored value useless to a reader of the database and lets a lookup be one indexed query.
"""

import hashlib
import hmac
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.datastructures import State

from app.config import Settings
from app.db import SessionDep
from app.errors import Forbidden, RateLimited, Unauthorized, raises
from app.key_cache import CachedKey, key_cache, key_miss_cache
from app.limits import InFlight
from app.tenants.models import ApiKey

KEY_PREFIX = "llk_"


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class TenantPrincipal:
    tenant_id: str
    api_key_id: str


def get_settings_from_app(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_settings_from_app)]


# The WWW-Authenticate of a Bearer route's 401 (RFC 6750 §3): no credential, or one refused.
BEARER_CHALLENGE = "Bearer"
INVALID_TOKEN_CHALLENGE = 'Bearer error="invalid_token"'


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(
            "missing or malformed Authorization header; expected 'Bearer <key>'", challenge=BEARER_CHALLENGE
        )
    return token.strip()


@contextmanager
def bearer_challenge() -> Iterator[None]:
    """A 401 raised inside names the Bearer scheme: the key lookups below are shared with the
    Tinker API, whose X-API-Key has no scheme to name, so the Bearer routes add it here."""
    try:
        yield
    except Unauthorized as exc:
        if exc.challenge is None:
            exc.challenge = INVALID_TOKEN_CHALLENGE
        raise


# The three ways to call the service, as OpenAPI security schemes: a route that depends on
# require_tenant / require_admin / require_worker is documented with its scheme. auto_error=False:
# the header is parsed and refused below, so a refusal is the app's own 401 body.
TENANT_SCHEME = HTTPBearer(
    scheme_name="TenantKey", description="A tenant's API key (`llk_...`).", auto_error=False
)
ADMIN_SCHEME = HTTPBearer(
    scheme_name="AdminKey", description="The service's admin key (`LORALOOM_ADMIN_KEY`).", auto_error=False
)
WORKER_SCHEME = HTTPBearer(
    scheme_name="WorkerToken",
    description="The worker pool's token (`LORALOOM_WORKER_TOKEN`).",
    auto_error=False,
)
_Credentials = HTTPAuthorizationCredentials | None


def same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _is_tenant_key(session: Session, token: str) -> bool:
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(token)))
    return key is not None and key.revoked_at is None


def _is_service_secret(token: str, secret: SecretStr | None) -> bool:
    return secret is not None and same_secret(token, secret.get_secret_value())


def _wrong_role(role: str) -> Forbidden:
    return Forbidden(f"this key is valid but may not use this route ({role} required)")


# 401 vs 403 (README, "Errors"): 401 when the caller is nobody this route knows (no key, a
# malformed header, an unknown or revoked key; on tenant routes anything but a tenant key);
# 403 when it is a valid credential of another role on an admin or pool route (a tenant key,
# the admin key on a pool route, the worker token on an admin route).


INVALID_KEY = "invalid or revoked API key"


def cached_key(state: State, digest: str) -> CachedKey | None:
    """What the key caches say of the key with this hash (app/key_cache.py): its tenant and id (a
    valid key looked up in the last few seconds: the revocation bound), or None (not known: look it
    up). A key found unknown or revoked within `api_key_miss_cache_seconds` is refused (Unauthorized)."""
    settings: Settings = state.settings
    if (hit := key_cache(state, settings.api_key_cache_seconds).get(digest)) is not None:
        return hit
    if key_miss_cache(state, settings.api_key_miss_cache_seconds).get(digest):
        raise Unauthorized(INVALID_KEY)
    return None


def known_key(state: State, session: Session, digest: str) -> CachedKey:
    """The tenant and id of the valid key with this hash (401 if there is none), from the caches or
    the database; what the database says is cached either way."""
    if (hit := cached_key(state, digest)) is not None:
        return hit
    settings: Settings = state.settings
    valid = key_cache(state, settings.api_key_cache_seconds)
    read_in = valid.generation  # before the read: a revocation clearing the cache meanwhile wins
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest))
    if key is None or key.revoked_at is not None:
        key_miss_cache(state, settings.api_key_miss_cache_seconds).put(digest, True)
        raise Unauthorized(INVALID_KEY)
    found = CachedKey(tenant_id=key.tenant_id, api_key_id=key.id)
    valid.put(digest, found, read_in=read_in)
    return found


@raises(Unauthorized, RateLimited)
def require_tenant(
    request: Request, session: SessionDep, _: Annotated[_Credentials, Security(TENANT_SCHEME)]
) -> Iterator[TenantPrincipal]:
    with bearer_challenge():
        key = known_key(request.app.state, session, hash_key(bearer_token(request)))
    yield from counted(request, TenantPrincipal(tenant_id=key.tenant_id, api_key_id=key.api_key_id))


def counted(request: Request, principal: TenantPrincipal) -> Iterator[TenantPrincipal]:
    with in_flight_place(request, principal.tenant_id):
        yield principal


@contextmanager
def in_flight_place(request: Request, tenant_id: str) -> Iterator[None]:
    """One of the tenant's `tenant_max_in_flight` places, held inside (app/limits.py): one tenant's
    flood gets 429s (RateLimited) while the others' requests still find threads and database
    connections. The API's routes (TenantDep) and the dashboard's pages (app/ui/router.py) share it."""
    in_flight: InFlight = request.app.state.in_flight
    in_flight.acquire(tenant_id)
    try:
        yield
    finally:
        in_flight.release(tenant_id)


@raises(Unauthorized, Forbidden)
def require_admin(
    request: Request,
    settings: SettingsDep,
    session: SessionDep,
    _: Annotated[_Credentials, Security(ADMIN_SCHEME)],
) -> None:
    token = bearer_token(request)
    if settings.admin_key is None:
        raise Forbidden("admin routes are disabled: LORALOOM_ADMIN_KEY is not set")
    if _is_service_secret(token, settings.admin_key):
        return
    if _is_service_secret(token, settings.worker_token) or _is_tenant_key(session, token):
        raise _wrong_role("the admin key")
    raise Unauthorized("invalid admin key", challenge=INVALID_TOKEN_CHALLENGE)


@raises(Unauthorized, Forbidden)
def require_worker(
    request: Request,
    settings: SettingsDep,
    session: SessionDep,
    _: Annotated[_Credentials, Security(WORKER_SCHEME)],
) -> None:
    token = bearer_token(request)
    if settings.worker_token is None:
        raise Forbidden("pool routes are disabled: LORALOOM_WORKER_TOKEN is not set")
    if _is_service_secret(token, settings.worker_token):
        return
    if _is_service_secret(token, settings.admin_key) or _is_tenant_key(session, token):
        raise _wrong_role("the worker token")
    raise Unauthorized("invalid worker token", challenge=INVALID_TOKEN_CHALLENGE)


TenantDep = Annotated[TenantPrincipal, Depends(require_tenant, scope="function")]
AdminDep = Annotated[None, Depends(require_admin)]
WorkerDep = Annotated[None, Depends(require_worker)]
