"""What the trainer pushes back per run: adapters per step, metrics per step, checkpoint commits."""

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Float, ForeignKey, Integer, String, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow


class Adapter(Base):
    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(512))
    """The PEFT directory (broadcast/step_N), relative to data_dir."""
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    """Of the safetensors file; also the ETag."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class StepMetrics(Base):
    __tablename__ = "step_metrics"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    """loss, entropy, mismatch_kl, masked_fraction, grad_norm, lr, tokens, samples, step_time_s"""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    total_samples: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantAdapter(Base):
    """A PEFT adapter a tenant uploaded (POST /v1/adapters), to start runs from (`init_from.adapter_id`)."""

    __tablename__ = "tenant_adapters"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    base_model: Mapped[str] = mapped_column(String(256))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    """What the upload takes on disk: its two files and their tar.gz, as written (`size_bytes` is the
    files alone, what the API reports). The tenant's uploads are bounded by their sum
    (`Settings.tenant_max_adapter_bytes`)."""
    sha256: Mapped[str] = mapped_column(String(64))
    """Of the safetensors file."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
