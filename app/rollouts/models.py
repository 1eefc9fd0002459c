"""Per rollout step of a run: the running aggregate of its samples' rewards and metrics."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class RolloutStats(Base):
    """Count, mean, M2 (sum of squared deviations), min and max of the rewards of one rollout
    step: enough to merge batch after batch exactly (Chan et al.) and to give mean and std."""

    __tablename__ = "rollout_stats"
    __table_args__ = (UniqueConstraint("run_id", "rollout_step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    rollout_step: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    """Samples received for this step, with or without a reward."""
    reward_count: Mapped[int] = mapped_column(Integer, default=0)
    reward_mean: Mapped[float] = mapped_column(Float, default=0.0)
    reward_m2: Mapped[float] = mapped_column(Float, default=0.0)
    reward_min: Mapped[float | None] = mapped_column(Float, default=None)
    reward_max: Mapped[float | None] = mapped_column(Float, default=None)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    """Per-sample metric name → [count, mean, m2, min, max]; at most MAX_STEP_METRICS names."""
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
