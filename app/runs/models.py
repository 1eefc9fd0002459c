"""Runs: one RL experiment of a tenant, its slot, progress and fate."""

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow
from contracts.status import RunStatus

EVICTED_BY = ("user", "trainer", "orchestrator", "heartbeat")

DELETED_RUNS = "status = 'deleted'"
"""The predicate of the partial index `ix_runs_deleted_updated_at`: a deleted run's `updated_at` is
its deletion's time (nothing writes a deleted run's row afterwards). Queries that should use the
index state it literally: a generic plan cannot see into a bound parameter (app/tinker/models.py)."""


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        # The database, not Python, guarantees that two active runs of one pool never share a slot.
        Index(
            "uq_runs_active_slot",
            "base_model",
            "slot",
            unique=True,
            postgresql_where=text("status = 'active'"),
            sqlite_where=text("status = 'active'"),
        ),
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_runs_tenant_status", "tenant_id", "status"),
        Index("ix_runs_status_created", "status", "created_at"),
        # The retention purge (app/retention.py) walks the deleted runs oldest deletion first; the
        # index holds only deleted runs, a retention's worth (the purge removes the older ones).
        Index(
            "ix_runs_deleted_updated_at",
            "updated_at",
            postgresql_where=text(DELETED_RUNS),
            sqlite_where=text(DELETED_RUNS),
        ),
    )

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    init_from: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """{"run_id", "step"}: the adapter the run starts from (`init_from`), resolved at creation."""
    """The validated RunConfig, as JSON."""
    base_model: Mapped[str] = mapped_column(String(256))
    """Copied out of the config: slots are per base model (one pool per base model)."""
    status: Mapped[str] = mapped_column(String(16), default=RunStatus.QUEUED)
    """A contracts.status.RunStatus value."""
    slot: Mapped[int | None] = mapped_column(Integer, default=None)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    total_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    submitted_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    """Samples accepted in rollout batches so far: the next batch's sample_offset."""
    eviction_reason: Mapped[str | None] = mapped_column(Text, default=None)
    evicted_by: Mapped[str | None] = mapped_column(String(16), default=None)
    failure_reason: Mapped[str | None] = mapped_column(Text, default=None)
    idempotency_key: Mapped[str | None] = mapped_column(String(128), default=None)
    request_hash: Mapped[str | None] = mapped_column(String(64), default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
