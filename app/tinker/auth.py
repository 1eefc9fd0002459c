"""Tinker callers: the SDK sends `X-API-Key: tml-<key>` and refuses keys without that prefix.

A loraloom tenant key works for both APIs: `tml-` + the key. The prefix is stripped and the rest
is looked up exactly as a Bearer key is (same sha256, same revocation, same tenant scoping), so
no second kind of secret is stored.
"""

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.auth import TenantPrincipal, hash_key
from app.db import SessionDep
from app.errors import Unauthorized
from app.tenants.models import ApiKey

TINKER_KEY_PREFIX = "tml-"


def require_tinker_tenant(request: Request, session: SessionDep) -> TenantPrincipal:
    return tinker_tenant(session, request)


def tinker_tenant(session: Session, request: Request) -> TenantPrincipal:
    """The caller of a Tinker route, from its X-API-Key (401 if missing, malformed or revoked)."""
    given = request.headers.get("x-api-key", "").strip()
    if not given.startswith(TINKER_KEY_PREFIX):
        raise Unauthorized("missing or malformed X-API-Key header; expected 'tml-' + a loraloom API key")
    key = session.scalar(
        select(ApiKey).where(ApiKey.key_hash == hash_key(given.removeprefix(TINKER_KEY_PREFIX)))
    )
    if key is None or key.revoked_at is not None:
        raise Unauthorized("invalid or revoked API key")
    return TenantPrincipal(tenant_id=key.tenant_id, api_key_id=key.id)


TinkerTenantDep = Annotated[TenantPrincipal, Depends(require_tinker_tenant)]
