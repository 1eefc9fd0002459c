"""The audit log: who did what to which run, when, from which key."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow

ACTORS = ("admin", "tenant", "trainer", "orchestrator", "heartbeat", "system")


class Event(Base):
    """One entry of the audit log. Append-only; never holds secrets."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    tenant_id: Mapped[str | None] = mapped_column(String(32), index=True, default=None)
    run_id: Mapped[str | None] = mapped_column(String(16), index=True, default=None)
    actor: Mapped[str] = mapped_column(String(32))
    """admin | tenant | trainer | orchestrator | heartbeat | system"""
    api_key_id: Mapped[str | None] = mapped_column(String(32), default=None)
    action: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
