"""Who is calling: a tenant (API key), the admin (admin key) or a worker pool (worker token).

Keys are high-entropy random strings, so a plain sha256 is the right hash: it makes the
stored value useless to a reader of the database and lets a lookup be one indexed query.
"""

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select

from app.config import Settings
from app.db import SessionDep
from app.errors import Forbidden, Unauthorized
from app.key_cache import key_cache
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


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing or malformed Authorization header; expected 'Bearer <key>'")
    return token.strip()


def _same_secret(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def require_tenant(request: Request, session: SessionDep) -> TenantPrincipal:
    token = bearer_token(request)
    digest = hash_key(token)
    # A valid key looked up in the last few seconds is trusted (app/key_cache.py: the revocation bound).
    cache = key_cache(request.app.state, request.app.state.settings.api_key_cache_seconds)
    if (hit := cache.get(digest)) is not None:
        return TenantPrincipal(tenant_id=hit.tenant_id, api_key_id=hit.api_key_id)
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest))
    if key is None or key.revoked_at is not None:
        raise Unauthorized("invalid or revoked API key")
    cache.put(digest, tenant_id=key.tenant_id, api_key_id=key.id)
    return TenantPrincipal(tenant_id=key.tenant_id, api_key_id=key.id)


def require_admin(request: Request, settings: SettingsDep) -> None:
    token = bearer_token(request)
    if settings.admin_key is None:
        raise Forbidden("admin routes are disabled: LORALOOM_ADMIN_KEY is not set")
    if not _same_secret(token, settings.admin_key.get_secret_value()):
        # A valid tenant key on an admin route is a 403 (authenticated, not allowed);
        # anything else is a 401.
        raise (
            Forbidden("admin key required")
            if token.startswith(KEY_PREFIX)
            else Unauthorized("invalid admin key")
        )


def require_worker(request: Request, settings: SettingsDep) -> None:
    token = bearer_token(request)
    if settings.worker_token is None:
        raise Forbidden("pool routes are disabled: LORALOOM_WORKER_TOKEN is not set")
    if not _same_secret(token, settings.worker_token.get_secret_value()):
        raise Unauthorized("invalid worker token")


TenantDep = Annotated[TenantPrincipal, Depends(require_tenant)]
AdminDep = Annotated[None, Depends(require_admin)]
WorkerDep = Annotated[None, Depends(require_worker)]
