"""The run lifecycle: create, admit to a slot, evict, complete, fail, delete, heartbeat.

    queued ──admit──▶ active ──▶ completed | evicted | failed
       └──────────────────────▶ evicted | failed
    any state but deleted ──▶ deleted

Only queued and active runs move (a 409 otherwise); deletion is the exception, as it
is how finished runs are cleaned up. Every slot or quota decision takes the admission
lock first (see admission.py). Keyword-only, raises domain errors, never commits.
"""

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.config import Settings
from app.db import utcnow
from app.errors import Conflict, NotFound, RateLimited, ValidationFailed
from app.events.after_commit import call_after_commit
from app.events.deletion import DELETION_ACTION
from app.events.service import record_event
from app.limits import QUEUED_RUNS_RETRY_AFTER_SECONDS
from app.pagination import paginate
from app.pools.capabilities import untrainable_reason
from app.projection import project_after_commit, project_run, remove_run_dir
from app.runs.admission import (
    creation_problems,
    live_pool,
    lock_admission,
    refusal_reason,
    slot_count,
    waiting_reason,
)
from app.runs.init_from import resolve_init_from
from app.runs.models import EVICTED_BY, Run
from app.runs.schemas import RunCreate
from app.tenants.models import Tenant
from app.timestamps import as_utc
from contracts.ids import is_run_id, new_id
from contracts.status import MOVABLE_RUN_STATUSES, RunStatus

log = logging.getLogger(__name__)


# --- lookups ---------------------------------------------------------------------------


def get_run(session: Session, *, run_id: str) -> Run:
    """The run, or a 404; a malformed id is not found either (run ids become paths, so no other
    shape gets near the disk)."""
    run = session.get(Run, run_id) if is_run_id(run_id) else None
    if run is None:
        raise NotFound(f"run {run_id} not found")
    return run


def get_run_for_tenant(session: Session, *, tenant_id: str, run_id: str) -> Run:
    """The tenant's run; another tenant's run is reported exactly like a missing one."""
    run = session.get(Run, run_id) if is_run_id(run_id) else None
    if run is None or run.tenant_id != tenant_id:
        raise NotFound(f"run {run_id} not found")
    return run


def list_runs(
    session: Session, *, tenant_id: str, status: RunStatus | None, limit: int, cursor: str | None
) -> tuple[list[Run], str | None]:
    """The tenant's runs, newest first; deleted runs only when asked for by status."""
    stmt = select(Run).where(Run.tenant_id == tenant_id)
    stmt = stmt.where(Run.status == status) if status else stmt.where(Run.status != RunStatus.DELETED)
    return paginate(session, stmt, created_col=Run.created_at, id_col=Run.id, limit=limit, cursor=cursor)


# --- create and admit ------------------------------------------------------------------


def create_run(
    session: Session,
    *,
    tenant_id: str,
    api_key_id: str | None,
    body: RunCreate,
    idempotency_key: str | None,
    settings: Settings,
) -> tuple[Run, bool]:
    """Create a run and admit it if a slot and the quota allow. Returns (run, created):
    created is False for an idempotent replay (same key, same body).

    A run the live pool of its base model cannot train is failed at once, with the reason.
    """
    request_hash = body.request_hash()
    lock_admission(session)
    # The tenant row lock also serialises this tenant's idempotent replays.
    if session.scalar(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update()) is None:
        raise NotFound(f"tenant {tenant_id} not found")
    if idempotency_key is not None:
        existing = _replay(
            session, tenant_id=tenant_id, idempotency_key=idempotency_key, request_hash=request_hash
        )
        if existing is not None:
            return existing, False
    _check_queue_room(session, tenant_id=tenant_id, settings=settings)
    # A run the live pool cannot train is refused outright (nothing stored): the 422 names each
    # field and the pool's limit. (With no live pool the run waits; a pool registering later
    # fails the runs it cannot train, with the reason.)
    problems = creation_problems(session, config=body.config)
    if problems:
        raise ValidationFailed(
            f"the pool serving {body.config.base_model!r} cannot train this run: "
            + "; ".join(p["msg"] for p in problems),
            details=problems,
        )
    init_from = (
        resolve_init_from(session, tenant_id=tenant_id, request=body.init_from, config=body.config)
        if body.init_from is not None
        else None
    )
    run = Run(
        id=new_id("run"),
        tenant_id=tenant_id,
        name=body.name,
        config=body.config.model_dump(mode="json"),
        init_from=init_from,
        base_model=body.config.base_model,
        status=RunStatus.QUEUED,
        idempotency_key=idempotency_key,
        request_hash=request_hash,
    )
    session.add(run)
    session.flush()
    record_event(
        session,
        action="run.created",
        actor="tenant",
        tenant_id=tenant_id,
        run_id=run.id,
        api_key_id=api_key_id,
        details={"name": body.name, "base_model": run.base_model},
    )
    reason = refusal_reason(session, config=run.config)
    if reason is not None:
        # Failed now rather than after waiting in the queue for a slot it could not use.
        fail_run(session, run=run, reason=reason, settings=settings)
    else:
        # The new run joins the queue and admission takes the queue in order, so it never
        # overtakes an older queued run that fits.
        admit_queued_runs(session, base_model=run.base_model, settings=settings)
        if run.status == RunStatus.QUEUED:
            record_event(
                session,
                action="run.queued",
                actor="system",
                tenant_id=tenant_id,
                run_id=run.id,
                details={"reason": waiting_reason(session, run=run, settings=settings)},
            )
    project_after_commit(session, run, settings)
    return run, True


def _replay(session: Session, *, tenant_id: str, idempotency_key: str, request_hash: str) -> Run | None:
    """The run an earlier request with this key created, or None; 409 if that request's body differed."""
    existing = session.scalar(
        select(Run).where(Run.tenant_id == tenant_id, Run.idempotency_key == idempotency_key)
    )
    if existing is not None and existing.request_hash != request_hash:
        raise Conflict(
            "Idempotency-Key was already used with a different body",
            details={"run_id": existing.id},
            code="idempotency_conflict",
        )
    return existing


@dataclass
class _TenantQuotas:
    """Active runs per tenant against their quotas, for one admission round. A tenant's quota row
    is locked when first read, so a concurrent quota change waits for the round to end."""

    session: Session
    active: dict[str, int]
    limits: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, session: Session) -> "_TenantQuotas":
        counts = session.execute(
            select(Run.tenant_id, func.count()).where(Run.status == RunStatus.ACTIVE).group_by(Run.tenant_id)
        ).tuples()
        return cls(session=session, active=dict(counts.all()))

    def has_room(self, tenant_id: str) -> bool:
        if tenant_id not in self.limits:
            limit = self.session.scalar(
                select(Tenant.max_concurrent_runs).where(Tenant.id == tenant_id).with_for_update()
            )
            self.limits[tenant_id] = limit or 0
        return self.active.get(tenant_id, 0) < self.limits[tenant_id]

    def take(self, tenant_id: str) -> None:
        self.active[tenant_id] = self.active.get(tenant_id, 0) + 1


def _free_slots(session: Session, *, base_model: str, slots: int) -> list[int]:
    used = set(
        session.scalars(select(Run.slot).where(Run.base_model == base_model, Run.status == RunStatus.ACTIVE))
    )
    return [i for i in range(slots) if i not in used]


def _check_queue_room(session: Session, *, tenant_id: str, settings: Settings) -> None:
    """429 when the tenant already has `tenant_max_queued_runs` runs waiting for a slot."""
    queued = session.scalar(
        select(func.count()).where(Run.tenant_id == tenant_id, Run.status == RunStatus.QUEUED)
    )
    limit = settings.tenant_max_queued_runs
    if queued is not None and queued >= limit:
        raise RateLimited(
            f"this tenant has {queued} runs queued for a slot (limit {limit}); retry once some have "
            "started or been evicted",
            details={"kind": "queued_runs", "queued_runs": queued, "limit": limit},
            retry_after=QUEUED_RUNS_RETRY_AFTER_SECONDS,
        )


def admit_queued_runs(session: Session, *, base_model: str, settings: Settings) -> list[Run]:
    """Give free slots of `base_model` to queued runs, oldest first, within their tenants' quotas.

    Before a run gets a slot, the live pool of its base model must be able to train it (the
    capability check); a run it cannot train is failed with the reason instead.
    """
    lock_admission(session)
    pool = live_pool(session, base_model=base_model)
    free = _free_slots(session, base_model=base_model, slots=slot_count(pool, settings=settings))
    admitted: list[Run] = []
    if not free:
        return admitted
    # Ids and tenants only: the whole row (its config) is read for the runs that may be admitted,
    # not for every run of a tenant at its quota (this runs under the service-wide lock).
    queued = session.execute(
        select(Run.id, Run.tenant_id)
        .where(Run.base_model == base_model, Run.status == RunStatus.QUEUED)
        .order_by(Run.created_at, Run.id)
    ).all()
    quotas = _TenantQuotas.read(session)
    for run_id, tenant_id in queued:
        if not free:
            break
        if not quotas.has_room(tenant_id):
            continue
        run = session.get_one(Run, run_id)
        reason = None if pool is None else untrainable_reason(run.config, pool)
        if reason is not None:
            fail_run(session, run=run, reason=reason, settings=settings)
            continue
        slot = free.pop(0)
        if not _take_slot(session, run=run, slot=slot):
            continue
        quotas.take(run.tenant_id)
        admitted.append(run)
        record_event(
            session,
            action="run.admitted",
            actor="system",
            tenant_id=run.tenant_id,
            run_id=run.id,
            details={"slot": slot},
        )
        project_run(run, settings)
    return admitted


def _take_slot(session: Session, *, run: Run, slot: int) -> bool:
    """Move a queued run into `slot`. The unique index is the backstop: if the slot turns out
    to be taken after all, the run stays queued (a savepoint keeps the transaction usable)."""
    try:
        with session.begin_nested():
            run.status = RunStatus.ACTIVE
            run.slot = slot
            run.started_at = utcnow()
            session.flush()
    except IntegrityError:
        log.warning("slot %d of %s already taken; %s stays queued", slot, run.base_model, run.id)
        session.refresh(run)
        return False
    return True


def _release(session: Session, *, run: Run, settings: Settings) -> None:
    """A run left its slot: the slot goes to its base model's queue, and its tenant's freed
    quota may let the tenant's runs queued on other base models in."""
    others = set(
        session.scalars(
            select(Run.base_model)
            .where(Run.tenant_id == run.tenant_id, Run.status == RunStatus.QUEUED)
            .distinct()
        )
    )
    for base_model in [run.base_model, *sorted(others - {run.base_model})]:
        admit_queued_runs(session, base_model=base_model, settings=settings)


def _lock_for_transition(session: Session, *, run: Run, action: str, allowed: tuple[RunStatus, ...]) -> None:
    """Take the admission lock, re-read the run under a row lock, and check it may move."""
    lock_admission(session)
    session.flush()
    session.refresh(run, with_for_update=True)
    if run.status not in allowed:
        only = " or ".join(allowed)
        # Every state but one may be deleted: naming the five others read as a riddle.
        message = (
            f"run {run.id} is already deleted"
            if run.status == RunStatus.DELETED and action == "deleted"
            else f"run {run.id} is {run.status}; only {only} runs can be {action}"
        )
        raise Conflict(
            message,
            details={"run_id": run.id, "status": run.status},
            code="invalid_transition",
        )


def _finish(session: Session, *, run: Run, status: RunStatus) -> bool:
    """Leave the lifecycle; returns whether the run held a slot."""
    was_active = run.status == RunStatus.ACTIVE
    run.status = status
    run.slot = None
    run.finished_at = utcnow()
    session.flush()
    return was_active


# --- leaving the lifecycle -------------------------------------------------------------


def evict_run(
    session: Session,
    *,
    run: Run,
    reason: str,
    evicted_by: str,
    actor: str,
    api_key_id: str | None = None,
    settings: Settings,
) -> Run:
    """Evict a queued or active run (reason kept, evicted.txt written); its slot goes to the queue."""
    if evicted_by not in EVICTED_BY:
        raise ValueError(f"evicted_by must be one of {EVICTED_BY}, not {evicted_by!r}")
    _lock_for_transition(session, run=run, action="evicted", allowed=MOVABLE_RUN_STATUSES)
    slot = run.slot
    run.eviction_reason = reason
    run.evicted_by = evicted_by
    was_active = _finish(session, run=run, status=RunStatus.EVICTED)
    record_event(
        session,
        action="run.evicted",
        actor=actor,
        tenant_id=run.tenant_id,
        run_id=run.id,
        api_key_id=api_key_id,
        details={"reason": reason, "evicted_by": evicted_by, "slot": slot},
    )
    project_run(run, settings)
    if was_active:
        _release(session, run=run, settings=settings)
    return run


def complete_run(session: Session, *, run: Run, settings: Settings) -> Run:
    """The run reached max_steps: completed, and its slot goes to the queue."""
    _lock_for_transition(session, run=run, action="completed", allowed=(RunStatus.ACTIVE,))
    slot = run.slot
    _finish(session, run=run, status=RunStatus.COMPLETED)
    record_event(
        session,
        action="run.completed",
        actor="trainer",
        tenant_id=run.tenant_id,
        run_id=run.id,
        details={"step": run.step, "slot": slot},
    )
    project_run(run, settings)
    _release(session, run=run, settings=settings)
    return run


def fail_run(session: Session, *, run: Run, reason: str, settings: Settings) -> Run:
    """The run cannot be trained (e.g. its config does not fit the pool): failed, with the
    reason in control/config_validation_error.txt."""
    _lock_for_transition(session, run=run, action="failed", allowed=MOVABLE_RUN_STATUSES)
    run.failure_reason = reason
    was_active = _finish(session, run=run, status=RunStatus.FAILED)
    record_event(
        session,
        action="run.failed",
        actor="system",
        tenant_id=run.tenant_id,
        run_id=run.id,
        details={"reason": reason},
    )
    project_run(run, settings)
    if was_active:
        _release(session, run=run, settings=settings)
    return run


def delete_run(
    session: Session, *, run: Run, actor: str, api_key_id: str | None = None, settings: Settings
) -> Run:
    """Delete a run in any state but deleted. The row stays (status `deleted`, for the audit
    trail) without its config's metadata; its directory is removed once the deletion is committed."""
    not_deleted = tuple(status for status in RunStatus if status != RunStatus.DELETED)
    _lock_for_transition(session, run=run, action="deleted", allowed=not_deleted)
    previous = run.status
    was_active = previous == RunStatus.ACTIVE
    run.status = RunStatus.DELETED
    run.slot = None
    if run.config.get("metadata"):
        # The user's free-form labels (up to 16 KiB) are kept by nothing that needs them: the events
        # hold name and base model, and the rest of the config (init_from's checks) stays. Without
        # this, create-and-delete loops grew the database by every run's metadata, for good.
        run.config = {**run.config, "metadata": {}}
    if run.finished_at is None:
        run.finished_at = utcnow()
    session.flush()
    record_event(
        session,
        action=DELETION_ACTION,
        actor=actor,
        tenant_id=run.tenant_id,
        run_id=run.id,
        api_key_id=api_key_id,
        details={"previous_status": previous},
    )
    # Not before the commit: a rolled-back deletion must not have destroyed the run's files.
    # A crash in between is repaired by the start-up rebuild, which removes deleted runs' dirs.
    run_id = run.id
    call_after_commit(session, lambda: remove_run_dir(run_id, settings))
    if was_active:
        _release(session, run=run, settings=settings)
    return run


# --- liveness --------------------------------------------------------------------------


def heartbeat(session: Session, *, run: Run) -> Run:
    """The orchestrator is alive. Terminal runs report their status unchanged, so an
    orchestrator learns from its heartbeat that it has been evicted."""
    if run.status in MOVABLE_RUN_STATUSES:
        run.last_heartbeat_at = utcnow()
        session.flush()
    return run


def _is_silent(run: Run, *, now: datetime, listening_since: datetime | None = None) -> bool:
    """Whether a queued or active run with a heartbeat_timeout has given no sign of life for longer
    than that: its last heartbeat, or if none its start, or while queued its creation; but not before
    `listening_since` (the sweeper's start: while the service was down no heartbeat could land)."""
    timeout: float | None = run.config.get("heartbeat_timeout")
    if not timeout or run.status not in MOVABLE_RUN_STATUSES:
        return False
    last_sign = as_utc(run.last_heartbeat_at or run.started_at or run.created_at)
    if listening_since is not None:
        last_sign = max(last_sign, as_utc(listening_since))
    return now - last_sign > timedelta(seconds=timeout)


def evict_silent_runs(
    session: Session, *, now: datetime, settings: Settings, listening_since: datetime | None = None
) -> list[Run]:
    """Evict queued or active runs whose orchestrator went silent (see `_is_silent`)."""
    now = as_utc(now)
    candidates = session.scalars(
        select(Run).where(Run.status.in_(MOVABLE_RUN_STATUSES)).order_by(Run.created_at, Run.id)
    ).all()
    due = [run for run in candidates if _is_silent(run, now=now, listening_since=listening_since)]
    if not due:  # the common case takes no lock (the sweeper calls this every few seconds)
        return []
    lock_admission(session)
    evicted: list[Run] = []
    for run in due:
        session.refresh(run)  # a heartbeat may have arrived before we held the lock
        if not _is_silent(run, now=now, listening_since=listening_since):
            continue
        timeout = run.config["heartbeat_timeout"]
        evict_run(
            session,
            run=run,
            reason=f"no heartbeat for more than {timeout:g}s (heartbeat_timeout)",
            evicted_by="heartbeat",
            actor="heartbeat",
            settings=settings,
        )
        evicted.append(run)
    return evicted
