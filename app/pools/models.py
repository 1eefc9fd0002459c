"""Registered worker pools and their liveness."""

from datetime import datetime

from sqlalchemy import JSON, DateTime, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow
from contracts.status import PoolStatus


class Pool(Base):
    __tablename__ = "pools"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(256), index=True)
    vocab_size: Mapped[int] = mapped_column(Integer)
    max_rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    slots: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    max_seq_len: Mapped[int] = mapped_column(Integer)
    module_shapes: Mapped[dict[str, list[int]] | None] = mapped_column(JSON, default=None)
    """(in, out) features per adaptable module type, as the pool registered them (None: not told)."""
    num_layers: Mapped[int | None] = mapped_column(Integer, default=None)
    """Longest sample (prompt + completion) the pool packs; runs with a larger seq_len are refused."""
    status: Mapped[str] = mapped_column(String(16), default=PoolStatus.ALIVE)
    """A contracts.status.PoolStatus value: alive | dead (silent past the timeout) | stopped (replaced)."""
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
