"""Worker pools: registration, liveness, and what they are given to train (DESIGN §3, §10).

One live pool per base model. A pool registers with its capabilities, heartbeats, and
polls the active runs of its base model. A pool silent for longer than
`pool_timeout_seconds` is declared dead by the sweeper and its leased batches go back
to pending; a dead pool's heartbeat gets a 409, which tells it to register again.

What a pool can train is decided by the pure check in capabilities.py, which admission
calls too; this service fails the runs a newly registered pool cannot train and hands
the pool's freed and new slots to admission.
"""

import logging
from datetime import datetime, timedelta

from sqlalchemy import and_, or_, select, text, update
from sqlalchemy.orm import Session

from app.batches.leases import extend_leases, return_pool_batches
from app.config import Settings
from app.db import rows_changed, utcnow
from app.errors import Conflict, NotFound
from app.pools.capabilities import untrainable_reason
from app.pools.models import Pool
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.runs.service import admit_queued_runs, fail_run
from app.tenants.models import DeletedRunId
from app.tinker.leases import return_pool_work
from app.tinker.models import TinkerFuture, claimable, unfinished
from contracts.ids import new_id
from contracts.pool_api import PoolRegister
from contracts.status import MOVABLE_RUN_STATUSES, PoolStatus, RunStatus

log = logging.getLogger(__name__)

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


def require_alive(pool: Pool) -> None:
    """A dead or replaced pool is a 409 (pool_dead, pool_stopped): it must register again."""
    if pool.status != PoolStatus.ALIVE:
        # The pool's leased batches were already handed back; it must not go on training
        # with a stale view, so it registers again (and restarts its runs from checkpoints).
        raise Conflict(
            f"pool {pool.id} is {pool.status}; register again",
            code="pool_dead" if pool.status == PoolStatus.DEAD else "pool_stopped",
            details={"pool_id": pool.id, "status": pool.status},
        )


def get_alive_pool(session: Session, *, pool_id: str) -> Pool:
    """The pool, if it is registered and alive; else a 404 or a 409 (see `require_alive`)."""
    pool = get_pool(session, pool_id=pool_id)
    require_alive(pool)
    return pool


def fail_untrainable_runs(
    session: Session,
    *,
    pool: Pool,
    settings: Settings,
    statuses: tuple[RunStatus, ...] = MOVABLE_RUN_STATUSES,
) -> list[str]:
    """Move every run of the pool's base model in `statuses` that the pool cannot train to
    `failed` (with the reason and control/config_validation_error.txt). Returns their ids."""
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
            reason = untrainable_reason(run.config, pool)
            if reason is None:
                continue
            # Admission's lock order: the admission lock before any run row.
            lock_admission(session)
            session.refresh(run, with_for_update=True)
            if run.status not in MOVABLE_RUN_STATUSES:
                continue  # moved on concurrently
            log.info("run %s failed admission: %s", run.id, reason)
            fail_run(session, run=run, reason=reason, settings=settings)
            failed.append(run.id)
    return failed


def register_pool(
    session: Session, *, spec: PoolRegister, settings: Settings, now: datetime | None = None
) -> tuple[Pool, list[str]]:
    """Register a pool for `spec.base_model`, replacing any pool registered before for it.

    A pool that registers again is a restarted pool: its earlier incarnation will never ack
    the batches it held, so those return to pending now rather than after the timeout.
    Runs the new pool cannot train are failed; queued runs are admitted into its slots. Returns
    the pool and the ids of the live pools it replaced.
    """
    now = now or utcnow()
    # Serialises registrations (two pools racing for one base model cannot both end up
    # alive) and the admission decisions below, in admission's lock order.
    lock_admission(session)
    previous = session.scalars(
        select(Pool)
        .where(Pool.base_model == spec.base_model, Pool.status == PoolStatus.ALIVE)
        .with_for_update()
    ).all()
    for old in previous:
        old.status = PoolStatus.STOPPED
        returned = return_pool_batches(session, pool_id=old.id)
        return_pool_work(session, pool_id=old.id)
        log.warning("pool %s replaced by a new registration; %s batch(es) returned", old.id, returned)

    pool = Pool(
        id=new_id("pool"),
        base_model=spec.base_model,
        vocab_size=spec.vocab_size,
        max_rank=spec.max_rank,
        target_modules=sorted(set(spec.target_modules)),
        slots=spec.slots,
        world_size=spec.world_size,
        max_seq_len=spec.max_seq_len,
        module_shapes={k: list(v) for k, v in spec.module_shapes.items()} if spec.module_shapes else None,
        num_layers=spec.num_layers,
        status=PoolStatus.ALIVE,
        registered_at=now,
        last_heartbeat_at=now,
    )
    session.add(pool)
    session.flush()
    fail_untrainable_runs(session, pool=pool, settings=settings)
    # The pool's slot count may be larger than the default the queue was admitted against.
    admit_queued_runs(session, base_model=pool.base_model, settings=settings)
    return pool, [old.id for old in previous]


def heartbeat_pool(
    session: Session, *, pool_id: str, settings: Settings, now: datetime | None = None
) -> Pool:
    """Mark the pool alive now and extend the leases of the batches it holds."""
    now = now or utcnow()
    # One conditional UPDATE, so a heartbeat racing the sweeper either lands before the pool
    # is declared dead (and keeps it alive) or sees it dead; never revives a dead pool.
    stamped = rows_changed(
        session,
        update(Pool)
        .where(Pool.id == pool_id, Pool.status == PoolStatus.ALIVE)
        .values(last_heartbeat_at=now)
        .execution_options(synchronize_session=False),
    )
    pool = get_pool(session, pool_id=pool_id)
    if stamped == 0:
        require_alive(pool)
    session.refresh(pool)
    extend_leases(session, pool_id=pool_id, now=now, lease_seconds=settings.lease_seconds)
    return pool


def deregister_pool(session: Session, *, pool_id: str) -> Pool:
    """The pool stops (Ctrl-C, SIGTERM): `stopped`, and the batches it holds go back to pending now,
    not after `pool_timeout_seconds`. Idempotent: a pool already dead or stopped keeps its status
    (its leases were returned when it got it)."""
    # The admission lock serialises this with a registration replacing the same pool.
    lock_admission(session)
    pool = get_pool(session, pool_id=pool_id)
    session.refresh(pool, with_for_update=True)
    if pool.status == PoolStatus.ALIVE:
        pool.status = PoolStatus.STOPPED
        returned = return_pool_batches(session, pool_id=pool.id)
        return_pool_work(session, pool_id=pool.id)
        log.info("pool %s deregistered; %s batch(es) returned to pending", pool.id, returned)
    return pool


def pool_state(session: Session, *, pool_id: str, settings: Settings) -> list[Run]:
    """The active runs of the pool's base model, by slot.

    Runs the pool cannot train are failed here too, so a run admitted by any path
    (including one racing the pool's registration) never reaches the trainer.
    """
    pool = get_alive_pool(session, pool_id=pool_id)
    for _ in range(_MAX_ENFORCE_ROUNDS):
        if not fail_untrainable_runs(session, pool=pool, settings=settings, statuses=(RunStatus.ACTIVE,)):
            break
    return list(
        session.scalars(
            select(Run)
            .where(Run.base_model == pool.base_model, Run.status == RunStatus.ACTIVE)
            .order_by(Run.slot)
        ).all()
    )


def deleted_runs(session: Session, *, run_ids: list[str]) -> list[str]:
    """Of `run_ids` (runs a pool has files for), those whose files it may remove, sorted: the runs this
    service holds with status deleted, or holds the ids of as deleted with their tenant, and only those.

    An id the service holds no row for is never named: it may be a run this service purged after the
    deletion's retention, but also a run of another service whose files share the pool's directory
    (the pool's default checkpoint directory is the service's default data directory, so `loraloom
    worker --url` at a remote service from where `loraloom serve` ran; a database restored or rebuilt
    beside the old checkpoint volume; two stacks sharing a `--checkpoint-dir`). Nothing tells these
    apart, and a removal cannot be undone, so the files of an unknown run stay. A tenant's deletion
    deletes its runs' rows (ON DELETE CASCADE) but keeps their ids (`DeletedRunId`,
    app/tenants/removal.py), which are named as deleted runs are. Known gap: a run whose row (or kept
    id) was purged (`deleted_run_retention_seconds`) before any pass of the pool asked about it keeps
    its files on a pool with its own checkpoint directory. The service's own data directory loses
    them either way (`projection.rebuild_all`).

    Evicted, completed and failed runs keep their files (an `init_from` checkpoint, an evicted Tinker
    model's saved states), and so does a deleted run whose files a run still reads:
    - a queued or active run starts from its checkpoint: the pool loads it when it admits that run,
      and again should it restart that run before its first checkpoint (the run was created before
      the deletion, which the service allows);
    - a Tinker `load_weights` names it as its source (`create_training_client_from_state` from a
      deleted model's saved state): while that load is pending or running, and while it is done but
      replayable (its request kept until its model's next checkpointed optim_step) with its model
      queued or active: a new pool for that model (a restart, another pool) loads the state again
      (app.tinker.leases, `REPLAYED_KINDS`)."""
    asked = sorted(set(run_ids))
    deleted = list(
        session.scalars(select(Run.id).where(Run.id.in_(asked), Run.status == RunStatus.DELETED)).all()
    )
    # Runs deleted with their tenant: their rows went with it, their ids stay (app/tenants/removal.py).
    # No run of another tenant starts from them (init_from and Tinker loads are the tenant's own), but
    # they go through the same check: it costs one query, and a removal cannot be undone.
    deleted += session.scalars(select(DeletedRunId.run_id).where(DeletedRunId.run_id.in_(asked))).all()
    if not deleted:
        return []
    source = Run.init_from["run_id"].as_string()
    pinned = {
        run_id
        for run_id, checkpoint in session.execute(
            select(source, Run.init_from["checkpoint"].as_integer()).where(
                Run.status.in_(MOVABLE_RUN_STATUSES), source.in_(deleted)
            )
        )
        if checkpoint is not None  # an adapter start reads the service's copy, not the pool's files
    }
    pinned.update(_loaded_from(session, [run_id for run_id in deleted if run_id not in pinned]))
    return sorted(run_id for run_id in deleted if run_id not in pinned)


def _loaded_from(session: Session, run_ids: list[str]) -> set[str]:
    """Of `run_ids`, the runs a Tinker load still reads the saved state of (see `deleted_runs`)."""
    if not run_ids:
        return set()
    table = TinkerFuture.__tablename__
    source = TinkerFuture.request["source_run_id"].as_string()
    return set(
        session.scalars(
            select(source)
            .distinct()
            .outerjoin(Run, Run.id == TinkerFuture.run_id)
            .where(
                TinkerFuture.kind == "load_weights",
                # Each arm the predicate of a partial index (unfinished, claimable), said literally
                # so that Postgres can read those instead of every retained future.
                or_(
                    text(f"({unfinished(table)})"),
                    and_(text(f"({claimable(table)})"), Run.status.in_(MOVABLE_RUN_STATUSES)),
                ),
                source.in_(run_ids),
            )
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
        .where(Pool.status == PoolStatus.ALIVE, Pool.last_heartbeat_at < cutoff)
        .with_for_update(skip_locked=True)
    ).all()
    dead: list[str] = []
    for pool in pools:
        pool.status = PoolStatus.DEAD
        returned = return_pool_batches(session, pool_id=pool.id)
        return_pool_work(session, pool_id=pool.id)
        log.warning(
            "pool %s (%s) silent since %s: declared dead, %s batch(es) returned to pending",
            pool.id,
            pool.base_model,
            pool.last_heartbeat_at.isoformat(),
            returned,
        )
        dead.append(pool.id)
    return dead
