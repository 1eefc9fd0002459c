"""Slot admission: how many slots a base model has, whether its pool can train a run, and the
lock that makes these decisions safe under concurrency.

Every decision that moves a run into or out of a slot runs under one admission lock
(a transaction-scoped advisory lock on Postgres; on SQLite every transaction already
begins with BEGIN IMMEDIATE, which serialises writers). The lock is global rather than
per base model because a tenant's quota spans base models: two admissions on different
models for one tenant must not both see the quota as free. The partial unique index
uq_runs_active_slot is the last line of defence for slots.

Lock order, to stay deadlock-free: the admission lock first, then tenant and run rows.
Code outside this package that locks run rows and then calls into the run service should
take `lock_admission` first.

Admission reads pools directly (the Pool rows and the pure capability check), never the pools
service: that service calls admission when a pool registers.
"""

import hashlib
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from app.config import Settings
from app.pools.capabilities import capability_field_problems, stored_config_problems, untrainable_reason
from app.pools.models import Pool
from app.runs.models import Run
from app.tenants.models import Tenant
from contracts.run_config import RunConfig
from contracts.status import PoolStatus, RunStatus

# A fixed 64-bit key for pg_advisory_xact_lock, derived from a readable name.
ADMISSION_LOCK_KEY = int.from_bytes(hashlib.sha256(b"loraloom.admission").digest()[:8], "big", signed=True)


def lock_admission(session: Session) -> None:
    """Serialise slot and quota decisions until the transaction ends (re-entrant)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK_KEY})


def live_pool(session: Session, *, base_model: str) -> Pool | None:
    """The pool currently serving `base_model`, if any (one live pool per base model)."""
    return session.scalar(
        select(Pool)
        .where(Pool.base_model == base_model, Pool.status == PoolStatus.ALIVE)
        .order_by(Pool.registered_at.desc(), Pool.id.desc())
        .limit(1)
    )


def live_pool_slots(session: Session, *, base_model: str) -> int | None:
    """The slot count of the live pool for `base_model`; None while no pool serves it."""
    pool = live_pool(session, base_model=base_model)
    return None if pool is None else pool.slots


def slot_count(pool: Pool | None, *, settings: Settings) -> int:
    """How many runs of a base model may be active at once: its live pool's slots, or
    settings.max_concurrent_runs while no pool serves it (DESIGN §10)."""
    if pool is None:
        # runs_wait_for_pool: a base model no live pool serves has no slots; its runs wait
        # (queued, with the reason GET /v1/runs/{id} shows) until a pool registers.
        return 0 if settings.runs_wait_for_pool else settings.max_concurrent_runs
    return pool.slots


def admission_problems(session: Session, *, config: dict[str, Any]) -> list[str]:
    """Why the live pool of the config's base model cannot train a run with `config`.

    Empty when it can, or when no pool serves that base model yet (the run then waits).
    """
    pool = live_pool(session, base_model=str(config.get("base_model", "")))
    return [] if pool is None else stored_config_problems(config, pool)


def refusal_reason(session: Session, *, config: dict[str, Any]) -> str | None:
    """`admission_problems` worded as the failure reason of a run that is refused
    (control/config_validation_error.txt); None if the run may wait for or take a slot."""
    pool = live_pool(session, base_model=str(config.get("base_model", "")))
    return None if pool is None else untrainable_reason(config, pool)


def creation_problems(session: Session, *, config: RunConfig) -> list[dict[str, Any]]:
    """Why the live pool of the config's base model cannot train it, as 422 details naming each
    field and the pool's limit; empty when it can or when no pool serves that base model yet."""
    pool = live_pool(session, base_model=config.base_model)
    return [] if pool is None else capability_field_problems(config, pool)


def waiting_reason(session: Session, *, run: Run, settings: Settings) -> str:
    """Why a queued run waits: its tenant's quota first (it holds whatever slots are free), then its
    base model's slots or pool. Reads only (no lock): for GET /v1/runs/{id} and the run.queued event."""
    active = session.scalar(
        select(func.count()).where(Run.tenant_id == run.tenant_id, Run.status == RunStatus.ACTIVE)
    )
    quota = session.scalar(select(Tenant.max_concurrent_runs).where(Tenant.id == run.tenant_id))
    if quota is not None and (active or 0) >= quota:
        return f"the tenant's quota of {quota} concurrent runs is in use"
    pool = live_pool(session, base_model=run.base_model)
    slots = slot_count(pool, settings=settings)
    if pool is None:
        if not slots:
            return f"waiting for a pool that serves {run.base_model!r}"
        return f"all {slots} slots for {run.base_model} are taken (no pool serves it yet)"
    return f"all {slots} slots of the pool serving {run.base_model} are taken"
