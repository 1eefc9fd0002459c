"""Dashboard sessions: server-side, so signing out (or revoking the key) ends them for good."""

from datetime import datetime

from sqlalchemy import Boolean, DateTime, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class UiSession(Base):
    __tablename__ = "ui_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    """sha256 hex of the cookie's secret (the secret itself is never stored)."""
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    """The signed-in tenant; None for an admin session."""
    api_key_id: Mapped[str | None] = mapped_column(String(32), default=None)
    """The key signed in with: revoking it ends the session."""
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    csrf_token: Mapped[str] = mapped_column(String(64))
    """Sent in every form of this session; a POST without it is refused."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    """Indexed: the sweeper deletes the expired sessions (app/ui/sessions.py purge_expired_sessions)."""
