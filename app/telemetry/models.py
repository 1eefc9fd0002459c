"""What the retention purge removed, counted, so that the Prometheus counters read from row counts
(app/telemetry/collector.py) never go down: a counter that drops reads to Prometheus as a restart,
and `rate()` over it jumps by the whole total."""

from sqlalchemy import BigInteger, String
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base


class PurgedCount(Base):
    __tablename__ = "purged_counts"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    """What was counted: one of `PURGED_*` (app/telemetry/purged.py)."""
    value: Mapped[int] = mapped_column(BigInteger, default=0)
