"""Worker pools: registration, liveness, and what a pool can train (DESIGN §3, §10).

One live pool per base model. A pool registers with its capabilities, heartbeats, and
polls the active runs of its base model. A pool silent for longer than
`pool_timeout_seconds` is declared dead by the sweeper and its leased batches go back
to pending; a dead pool's heartbeat gets a 409, which tells it to register again.
"""

import logging
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.batches.service import extend_leases, return_pool_batches
from app.config import Settings
from app.db import utcnow
from app.errors import Conflict, NotFound
from app.runs.models import Run
from app.pools.models import Pool
from contracts.ids import new_id
from contracts.pool_api import PoolRegister
from contracts.run_config import RunConfig

log = logging.getLogger(__name__)

POOL_ALIVE = "alive"
POOL_DEAD = "dead"
POOL_STOPPED = "stopped"
"""Replaced by a newer registration for the same base model (a restarted pool)."""

# Bounds the fail → re-query loop in pool_state; each round fails at least one run, so
# this is only reached if admission keeps handing the pool runs it cannot train.
_MAX_ENFORCE_ROUNDS = 64


def heartbeat_interval_s(settings: Settings) -> float:
    """How often a pool should heartbeat: a pool may miss three in a row and still be alive,
    and its leases (extended by each heartbeat) never run out while it is."""
    return max(0.1, min(settings.pool_timeout_seconds, settings.lease_seconds) / 4)


def get_pool(session: Session, *, pool_id: str) -> Pool:
    pool = session.get(Pool, pool_id)
    if pool is None:
        raise NotFound(f"pool {pool_id} not found; register the pool first", code="pool_not_found")
    return pool


def _require_alive(pool: Pool) -> None:
    if pool.status != POOL_ALIVE:
        # The pool's leased batches were already handed back; it must not go on training
        # with a stale view, so it registers again (and restarts its runs from checkpoints).
        raise Conflict(
            f"pool {pool.id} is {pool.status}; register again",
            code="pool_dead" if pool.status == POOL_DEAD else "pool_stopped",
            details={"pool_id": pool.id, "status": pool.status},
        )


def live_pool(session: Session, *, base_model: str) -> Pool | None:
    """The pool currently serving `base_model`, if any."""
    return session.scalar(
        select(Pool)
        .where(Pool.base_model == base_model, Pool.status == POOL_ALIVE)
        .order_by(Pool.registered_at.desc(), Pool.id.desc())
        .limit(1)
    )


def live_pool_slots(session: Session, *, base_model: str) -> int | None:
    """The slot count of the live pool for `base_model`; None while no pool serves it
    (admission then falls back to settings.max_concurrent_runs, DESIGN §10)."""
    pool = live_pool(session, base_model=base_model)
    return None if pool is None else pool.slots


def capability_problems(config: RunConfig, pool: Pool) -> list[str]:
    """Every reason `pool` cannot train a run with `config` (empty: it can)."""
    problems: list[str] = []
    if config.base_model != pool.base_model:
        problems.append(f"base_model {config.base_model!r} is not the pool's {pool.base_model!r}")
    if config.lora.rank > pool.max_rank:
        problems.append(f"lora.rank {config.lora.rank} exceeds the pool's max_rank {pool.max_rank}")
    unsupported = sorted(set(config.lora.target_modules) - set(pool.target_modules))
    if unsupported:
        problems.append(
            f"lora.target_modules {unsupported} are not adapted by the pool "
            f"(it adapts {sorted(pool.target_modules)})"
        )
    if config.seq_len > pool.max_seq_len:
        problems.append(f"seq_len {config.seq_len} exceeds the pool's max_seq_len {pool.max_seq_len}")
    return problems


def _problems_for_config(config: dict, pool: Pool) -> list[str]:
    try:
        parsed = RunConfig.model_validate(config)
    except ValidationError as exc:  # stored configs were validated at creation; this is a guard
        return [f"config is invalid: {exc.error_count()} error(s)"]
    return capability_problems(parsed, pool)


def pool_capability_problems(session: Session, *, config: dict) -> list[str]:
    """Why the live pool of the config's base model cannot train a run with `config`.

    Empty when it can, or when no pool serves that base model yet (the run then waits).
    Admission calls this before giving a run a slot (runs.admission.admission_problems).
    """
    pool = live_pool(session, base_model=str(config.get("base_model", "")))
    if pool is None:
        return []
    return _problems_for_config(config, pool)


def _rejection_reason(run: Run, pool: Pool) -> str | None:
    problems = _problems_for_config(run.config, pool)
    if not problems:
        return None
    return f"pool {pool.id} for base model {pool.base_model!r} cannot train this run: " + "; ".join(problems)


def fail_untrainable_runs(
    session: Session, *, pool: Pool, settings: Settings, statuses: tuple[str, ...] = ("queued", "active")
) -> list[str]:
    """Move every run of the pool's base model in `statuses` that the pool cannot train to
    `failed` (with the reason and control/config_validation_error.txt). Returns their ids."""
    # Imported here, not at the top: the runs service imports this module (through admission).
    from app.runs.admission import lock_admission
    from app.runs.service import fail_run

    failed: list[str] = []
    # Queued runs first: failing an active run frees its slot, and the run admitted into it
    # must not be one that is about to fail.
    for status in statuses:
        runs = session.scalars(
            select(Run)
            .where(Run.base_model == pool.base_model, Run.status == status)
            .order_by(Run.created_at)
        ).all()
        for run in runs:
            reason = _rejection_reason(run, pool)
            if reason is None:
                continue
            # Admission's lock order: the admission lock before any run row.
            lock_admission(session)
            session.refresh(run, with_for_update=True)
            if run.status not in ("queued", "active"):
                continue  # moved on concurrently
            log.info("run %s failed admission: %s", run.id, reason)
            fail_run(session, run=run, reason=reason, settings=settings)
            failed.append(run.id)
    return failed


def register_pool(
    session: Session, *, spec: PoolRegister, settings: Settings, now: datetime | None = None
) -> Pool:
    """Register a pool for `spec.base_model`, replacing any pool registered before for it.

    A pool that registers again is a restarted pool: its earlier incarnation will never ack
    the batches it held, so those return to pending now rather than after the timeout.
    Runs the new pool cannot train are failed; queued runs are admitted into its slots.
    """
    from app.runs.admission import lock_admission
    from app.runs.service import admit_queued_runs

    now = now or utcnow()
    # Serialises registrations (two pools racing for one base model cannot both end up
    # alive) and the admission decisions below, in admission's lock order.
    lock_admission(session)
    previous = session.scalars(
        select(Pool).where(Pool.base_model == spec.base_model, Pool.status == POOL_ALIVE).with_for_update()
    ).all()
    for old in previous:
        old.status = POOL_STOPPED
        returned = return_pool_batches(session, pool_id=old.id)
        log.info("pool %s replaced by a new registration; %s batch(es) returned", old.id, returned)

    pool = Pool(
        id=new_id("pool"),
        base_model=spec.base_model,
        vocab_size=spec.vocab_size,
        max_rank=spec.max_rank,
        target_modules=sorted(set(spec.target_modules)),
        slots=spec.slots,
        world_size=spec.world_size,
        max_seq_len=spec.max_seq_len,
        status=POOL_ALIVE,
        registered_at=now,
        last_heartbeat_at=now,
    )
    session.add(pool)
    session.flush()
    fail_untrainable_runs(session, pool=pool, settings=settings)
    # The pool's slot count may be larger than the default the queue was admitted against.
    admit_queued_runs(session, base_model=pool.base_model, settings=settings)
    return pool


def heartbeat_pool(
    session: Session, *, pool_id: str, settings: Settings, now: datetime | None = None
) -> Pool:
    """Mark the pool alive now and extend the leases of the batches it holds."""
    now = now or utcnow()
    # One conditional UPDATE, so a heartbeat racing the sweeper either lands before the pool
    # is declared dead (and keeps it alive) or sees it dead; never revives a dead pool.
    result = session.execute(
        update(Pool)
        .where(Pool.id == pool_id, Pool.status == POOL_ALIVE)
        .values(last_heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    pool = get_pool(session, pool_id=pool_id)
    if result.rowcount == 0:
        _require_alive(pool)
    session.refresh(pool)
    extend_leases(session, pool_id=pool_id, now=now, lease_seconds=settings.lease_seconds)
    return pool


def pool_state(session: Session, *, pool_id: str, settings: Settings) -> list[Run]:
    """The active runs of the pool's base model, by slot.

    Runs the pool cannot train are failed here too, so a run admitted by any path
    (including one racing the pool's registration) never reaches the trainer.
    """
    pool = get_pool(session, pool_id=pool_id)
    _require_alive(pool)
    for _ in range(_MAX_ENFORCE_ROUNDS):
        if not fail_untrainable_runs(session, pool=pool, settings=settings, statuses=("active",)):
            break
    return list(
        session.scalars(
            select(Run).where(Run.base_model == pool.base_model, Run.status == "active").order_by(Run.slot)
        ).all()
    )


def declare_dead_pools(session: Session, *, now: datetime, settings: Settings) -> list[str]:
    """Pools silent for longer than the timeout → dead, their claimed batches → pending."""
    cutoff = now - timedelta(seconds=settings.pool_timeout_seconds)
    # FOR UPDATE re-checks last_heartbeat_at after a concurrent heartbeat commits, so a
    # pool that heartbeated in the meantime is not declared dead; SKIP LOCKED leaves a
    # pool mid-heartbeat to the next sweep.
    pools = session.scalars(
        select(Pool)
        .where(Pool.status == POOL_ALIVE, Pool.last_heartbeat_at < cutoff)
        .with_for_update(skip_locked=True)
    ).all()
    dead: list[str] = []
    for pool in pools:
        pool.status = POOL_DEAD
        returned = return_pool_batches(session, pool_id=pool.id)
        log.warning(
            "pool %s (%s) silent since %s: declared dead, %s batch(es) returned to pending",
            pool.id,
            pool.base_model,
            pool.last_heartbeat_at.isoformat(),
            returned,
        )
        dead.append(pool.id)
    return dead
