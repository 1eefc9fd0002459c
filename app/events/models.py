"""The audit log: who did what to which run, when, from which key."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Index, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow

ACTORS = ("admin", "tenant", "trainer", "orchestrator", "heartbeat", "system")


class Event(Base):
    """One entry of the audit log. Append-only; never holds secrets."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_feed", "run_id", "txid", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    tenant_id: Mapped[str | None] = mapped_column(String(32), index=True, default=None)
    run_id: Mapped[str | None] = mapped_column(String(16), index=True, default=None)
    actor: Mapped[str] = mapped_column(String(32))
    """admin | tenant | trainer | orchestrator | heartbeat | system"""
    api_key_id: Mapped[str | None] = mapped_column(String(32), default=None)
    action: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    txid: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    """The writing transaction's id on Postgres (0 on SQLite): the run feed is ordered by
    (txid, id) and served only below the oldest running transaction, so a page never skips an
    event that commits later (app/events/feed.py)."""
