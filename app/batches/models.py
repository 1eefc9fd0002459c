"""Rollout batches: the payload lives in a file under the run's rollouts/, the row says where and in what state."""

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow
from contracts.status import BatchState


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        UniqueConstraint("run_id", "idempotency_key"),
        Index("ix_batches_state_id", "state", "id"),
        Index("ix_batches_run_id_id", "run_id", "id"),
        # A trainer step's batches, for the metrics join (app/adapters/metrics_view.py).
        Index("ix_batches_run_id_trained_step", "run_id", "trained_step"),
        # The per-run pending limits count these on every submission (app/limits.py).
        Index(
            "ix_batches_run_id_pending",
            "run_id",
            postgresql_where=text("state = 'pending'"),
            sqlite_where=text("state = 'pending'"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    """Monotonic: a run's batches are trained in id order."""
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    idempotency_key: Mapped[str | None] = mapped_column(String(128), default=None)
    request_hash: Mapped[str] = mapped_column(String(64))
    rollout_step: Mapped[int] = mapped_column(Integer)
    num_samples: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(Integer)
    sample_offset: Mapped[int] = mapped_column(BigInteger)
    """Index of this batch's first sample among all the run's samples (exactly-once resume)."""
    payload_path: Mapped[str] = mapped_column(String(512))
    """Relative to data_dir."""
    payload_bytes: Mapped[int] = mapped_column(Integer)
    payload_sha256: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), default=BatchState.PENDING)
    """A contracts.status.BatchState value."""
    pool_id: Mapped[str | None] = mapped_column(String(32), default=None)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    trained_step: Mapped[int | None] = mapped_column(Integer, default=None)
    """The run step whose optimizer update used this batch's last sample."""
    # The batch's rewards as app.rollouts.service.Summary (count, mean, M2, min, max), written at
    # ingestion from the summary merged into its rollout step's stats: a trainer step's
    # `trained_reward` merges exactly the batches it trained (app/adapters/metrics_view.py).
    # NULL (reward_count): stored before migration 0019, which has only its rollout step's stats.
    reward_count: Mapped[int | None] = mapped_column(Integer, default=None)
    """Samples with a reward (0: none had one); None: no per-batch summary (an older batch)."""
    reward_mean: Mapped[float | None] = mapped_column(Float, default=None)
    reward_m2: Mapped[float | None] = mapped_column(Float, default=None)
    reward_min: Mapped[float | None] = mapped_column(Float, default=None)
    reward_max: Mapped[float | None] = mapped_column(Float, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    trained_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
