"""Tinker callers: the SDK sends `X-API-Key: tml-<key>` and refuses keys without that prefix.

A loraloom tenant key works for both APIs: `tml-` + the key. The prefix is stripped and the rest
is looked up exactly as a Bearer key is (same sha256, same revocation, same tenant scoping), so
no second kind of secret is stored.
"""

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from app.auth import TenantPrincipal, counted, hash_key, known_key
from app.db import SessionDep
from app.errors import RateLimited, Unauthorized, raises

TINKER_KEY_PREFIX = "tml-"


@raises(Unauthorized, RateLimited)
def require_tinker_tenant(request: Request, session: SessionDep) -> Iterator[TenantPrincipal]:
    """The caller, counted against the tenant's in-flight limit while the route runs (as on
    /v1: one tenant's flood gets 429s while the others' requests still find threads and database
    connections)."""
    yield from counted(request, tinker_tenant(session, request))


def tinker_key_hash(request: Request) -> str:
    """The hash of the caller's key, from its X-API-Key (401 if missing or malformed). No I/O: the
    request guard (app/request_guard.py) checks it before reading a bulk body too."""
    given = request.headers.get("x-api-key", "").strip()
    if not given.startswith(TINKER_KEY_PREFIX):
        raise Unauthorized("missing or malformed X-API-Key header; expected 'tml-' + a loraloom API key")
    return hash_key(given.removeprefix(TINKER_KEY_PREFIX))


def tinker_tenant(session: Session, request: Request) -> TenantPrincipal:
    """The caller of a Tinker route, from its X-API-Key (401 if missing, malformed or revoked).
    A valid key looked up in the last few seconds is trusted, as for Bearer keys (app/key_cache.py:
    the revocation bound): `retrieve_future` authenticates every check of its long poll."""
    key = known_key(request.app.state, session, tinker_key_hash(request))
    return TenantPrincipal(tenant_id=key.tenant_id, api_key_id=key.api_key_id)


TinkerTenantDep = Annotated[TenantPrincipal, Depends(require_tinker_tenant, scope="function")]
