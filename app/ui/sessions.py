"""Signing in to the dashboard: an API key (or the admin key) for a server-side session; the
sweeper deletes the expired ones.

Each key holds at most MAX_SESSIONS_PER_KEY sessions: a sign-in past it ends the key's oldest
session rather than being refused. A refusal would let anyone holding the key (a script signing in
in a loop, a leaked copy) fill the key's places for 12 hours and lock its owner out of the
dashboard; ending the oldest costs the owner at most one more sign-in, and whoever holds the key can
sign in anyway. Successful sign-ins are not otherwise limited: failed ones are
(app/ui/login_limits.py), and a successful one needs the key."""

import hashlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, delete, select
from sqlalchemy.orm import Session

from app.auth import hash_key, same_secret
from app.config import Settings
from app.db import rows_changed, utcnow
from app.errors import Unauthorized
from app.events.service import record_event
from app.tenants.models import ApiKey
from app.timestamps import as_utc
from app.ui.models import UiSession

log = logging.getLogger(__name__)

COOKIE = "loraloom_session"
SESSION_LIFETIME = timedelta(hours=12)
MAX_SESSIONS_PER_KEY = 64
"""Dashboard sessions one API key (or the admin key) holds at once; a sign-in past it ends the oldest."""
PURGE_BATCH = 1000
"""Expired sessions one sweep deletes at most: the sweeper runs every few seconds, so a backlog
(a sign-in flood) goes in many short transactions rather than one long one."""


@dataclass(frozen=True)
class Viewer:
    """Who is looking at the dashboard."""

    session_id: str
    tenant_id: str | None
    is_admin: bool
    csrf_token: str


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def sign_in(session: Session, *, key: str, settings: Settings) -> str:
    """A new session for a valid tenant key or the admin key; returns the cookie's secret."""
    key = key.strip()
    admin = settings.admin_key
    tenant_id: str | None = None
    api_key_id: str | None = None
    if admin is not None and same_secret(key, admin.get_secret_value()):
        is_admin = True
    else:
        row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
        if row is None or row.revoked_at is not None:
            raise Unauthorized("invalid or revoked API key")
        is_admin, tenant_id, api_key_id = False, row.tenant_id, row.id
    ended = _make_room(session, tenant_id=tenant_id, api_key_id=api_key_id)
    secret = secrets.token_urlsafe(32)
    now = utcnow()
    session.add(
        UiSession(
            id=_digest(secret),
            tenant_id=tenant_id,
            api_key_id=api_key_id,
            is_admin=is_admin,
            csrf_token=secrets.token_urlsafe(32),
            created_at=now,
            expires_at=now + SESSION_LIFETIME,
        )
    )
    record_event(
        session,
        action="ui.signed_in",
        actor="admin" if is_admin else "tenant",
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        details={"sessions_ended": ended} if ended else None,
    )
    return secret


def _make_room(session: Session, *, tenant_id: str | None, api_key_id: str | None) -> int:
    """End the key's oldest sessions so that, with the one about to be added, it holds at most
    MAX_SESSIONS_PER_KEY; returns how many ended. Expired ones count until the sweeper deletes them
    (they are the oldest, so they go first). Concurrent sign-ins with one key may each keep the
    same newest ones and so pass the bound by a session each, until the key's next sign-in."""
    mine: ColumnElement[bool] = (
        # Through ix_ui_sessions_tenant_id: a tenant's sessions are its keys' (each at most the bound).
        (UiSession.tenant_id == tenant_id) & (UiSession.api_key_id == api_key_id)
        if api_key_id is not None
        else UiSession.tenant_id.is_(None) & UiSession.is_admin.is_(True)
    )
    kept = (
        select(UiSession.id)
        .where(mine)
        .order_by(UiSession.created_at.desc(), UiSession.id.desc())
        .limit(MAX_SESSIONS_PER_KEY - 1)
    )
    ended = rows_changed(
        session,
        delete(UiSession).where(mine, UiSession.id.not_in(kept)).execution_options(synchronize_session=False),
    )
    if ended:  # the event says so too; a line per sign-in of a flood is no use at info
        log.debug("a sign-in ended %s older dashboard session(s) of its key", ended)
    return ended


def resolve(session: Session, *, secret: str | None) -> Viewer | None:
    """The viewer of a cookie, or None (no cookie, signed out, expired, key revoked)."""
    if not secret or len(secret) > 128:
        return None
    row = session.get(UiSession, _digest(secret))
    if row is None or as_utc(row.expires_at) <= utcnow():
        return None
    if row.api_key_id is not None:
        key = session.get(ApiKey, row.api_key_id)
        if key is None or key.revoked_at is not None:
            return None
    return Viewer(row.id, row.tenant_id, row.is_admin, row.csrf_token)


def still_signed_in(session_id: str) -> Callable[[Session], bool]:
    """Whether a dashboard session still holds: not signed out, not expired, its key not revoked
    (what `resolve` checks), for a live event stream opened with it (app/events/router.py)."""

    def allowed(session: Session) -> bool:
        row = session.get(UiSession, session_id)
        if row is None or as_utc(row.expires_at) <= utcnow():
            return False
        if row.api_key_id is None:
            return True
        key = session.get(ApiKey, row.api_key_id)
        return key is not None and key.revoked_at is None

    return allowed


def sign_out(session: Session, *, viewer: Viewer) -> None:
    session.execute(delete(UiSession).where(UiSession.id == viewer.session_id))


def csrf_ok(viewer: Viewer, token: str | None) -> bool:
    return token is not None and same_secret(token, viewer.csrf_token)


def purge_expired_sessions(session: Session, *, now: datetime, limit: int = PURGE_BATCH) -> int:
    """Delete up to `limit` sessions expired by `now` (`resolve` already refuses them; the rows only
    take space). Returns how many. Walks ix_ui_sessions_expires_at, oldest first."""
    expired = select(UiSession.id).where(UiSession.expires_at <= now).order_by(UiSession.expires_at)
    purged = rows_changed(
        session,
        delete(UiSession)
        .where(UiSession.id.in_(expired.limit(limit)))
        .execution_options(synchronize_session=False),
    )
    if purged:
        log.info("%s expired dashboard session(s) purged", purged)
    return purged
