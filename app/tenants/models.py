"""Tenants and their API keys (stored hashed), and the ids of the runs deleted with a tenant."""

from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, Index, Integer, String, func
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow

TENANT_NAME_INDEX = "uq_tenants_lower_name"
"""The unique index on lower(name): `Acme` and `acme` are one name (migration 0023)."""


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    max_concurrent_runs: Mapped[int] = mapped_column(Integer, default=2)
    """Quota: how many of this tenant's runs may hold a slot at once."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    # Names are unique whatever their case. Names are ASCII (TenantCreate's pattern), where SQL's
    # lower() and Python's str.lower() agree on both backends.
    __table_args__ = (Index(TENANT_NAME_INDEX, func.lower(name), unique=True),)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """sha256 hex of the secret; the secret itself is shown once and never stored."""
    prefix: Mapped[str] = mapped_column(String(16))
    """First characters of the secret, so a user can tell keys apart in listings."""
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class DeletedRunId(Base):
    """A run deleted with its tenant: the tenant's deletion removes the run's row (ON DELETE CASCADE),
    so this is what still tells a pool asking about the run (`POST /v1/pool/runs/deleted`) that it was
    deleted and its files may go. Written in the tenant deletion's transaction
    (app/tenants/removal.py); purged `deleted_run_retention_seconds` after it, as a deleted run's own
    row is (app/retention.py). No foreign key: the run is gone."""

    __tablename__ = "deleted_run_ids"

    run_id: Mapped[str] = mapped_column(String(16), primary_key=True)
    deleted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
