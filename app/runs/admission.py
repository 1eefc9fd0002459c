"""Slot admission: how many slots a base model has, who may take one, and the lock that
makes the decision safe under concurrency.

Every decision that moves a run into or out of a slot runs under one admission lock
(a transaction-scoped advisory lock on Postgres; on SQLite every transaction already
begins with BEGIN IMMEDIATE, which serialises writers). The lock is global rather than
per base model because a tenant's quota spans base models: two admissions on different
models for one tenant must not both see the quota as free. The partial unique index
uq_runs_active_slot is the last line of defence for slots.

Lock order, to stay deadlock-free: the admission lock first, then tenant and run rows.
Code outside this package that locks run rows and then calls into the run service should
take `lock_admission` first.
"""

import hashlib

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.config import Settings
from app.pools.service import live_pool_slots

# A fixed 64-bit key for pg_advisory_xact_lock, derived from a readable name.
ADMISSION_LOCK_KEY = int.from_bytes(hashlib.sha256(b"loraloom.admission").digest()[:8], "big", signed=True)


def lock_admission(session: Session) -> None:
    """Serialise slot and quota decisions until the transaction ends (re-entrant)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK_KEY})


def slots_for(session: Session, *, base_model: str, settings: Settings) -> int:
    """How many runs of `base_model` may be active at once (one pool per base model)."""
    return live_pool_slots(session, base_model=base_model) or settings.max_concurrent_runs


def admission_problems(session: Session, *, config: dict, settings: Settings) -> list[str]:
    """Why a run with this config cannot be trained by its pool (empty: it can).

    Checked when a run is admitted; a problem moves the run to `failed` and is written to
    control/config_validation_error.txt. Nothing to check until pools register their
    capabilities (base model, maximum rank, target modules).
    """
    return []
