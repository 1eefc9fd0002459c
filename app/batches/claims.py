"""Rollout batches from the pool's side: claims, acks, and restarts from a checkpoint; exactly-once
across restarts (DESIGN §4.3).

The pool claims the oldest pending batches of its base model's active runs, round-robin across
runs; a claim lasts `lease_seconds` (leases.py: how a lease is extended, expires or is returned)
and ends with an ack, once the optimizer step that used the batch is done. A pool that restarts a
run from a checkpoint gets every batch trained after it back as pending, to train it again.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from app.batches.leases import expire_leases
from app.batches.models import Batch
from app.batches.storage import PayloadUnreadable, read_payload_bytes
from app.config import Settings
from app.errors import Conflict
from app.events.service import record_event
from app.pools.service import get_alive_pool
from app.runs.models import Run
from app.runs.service import get_run
from contracts.status import BatchState, RunStatus

log = logging.getLogger("loraloom.batches")

_CLAIM_ROUNDS = 3
"""A claimer that loses its candidates to a concurrent claimer (SKIP LOCKED) looks again this often."""


@dataclass(frozen=True)
class ClaimedItem:
    batch: Batch
    slot: int | None
    payload: bytes
    """The stored bytes, as stored (served as they are in a msgpack claim)."""


@dataclass(frozen=True)
class Claim:
    lease_expires_at: datetime
    items: list[ClaimedItem]


ROLLOUT_RUN = func.coalesce(Run.config["mode"].as_string(), "rollout") != "manual"
"""A run that trains on rollout batches: not a Tinker model's (`mode` manual), which the ingestion
refuses batches for (service.RunIsManual). Checked here too, so that no batch stored for one (before
that refusal existed) is ever trained into it, using up the gradients its user accumulated."""


def _claimable_runs(session: Session, *, pool_id: str) -> list[tuple[str, int | None]]:
    """(run id, slot) of the active rollout runs of the pool's base model; a 404 or 409 if the pool
    is not registered or not alive (it must register again)."""
    pool = get_alive_pool(session, pool_id=pool_id)
    rows = session.execute(
        select(Run.id, Run.slot)
        .where(Run.status == RunStatus.ACTIVE, Run.base_model == pool.base_model, ROLLOUT_RUN)
        .order_by(Run.id)
    )
    return [(r.id, r.slot) for r in rows]


def _fair_candidates(session: Session, *, run_ids: Sequence[str], limit: int, exclude: set[int]) -> list[int]:
    """Up to `limit` pending batch ids, round-robin across runs: every run's oldest first, then
    every run's second oldest, …; each run's batches stay in id order (the order they are trained in)."""
    queues: list[list[int]] = []
    for run_id in run_ids:
        stmt = select(Batch.id).where(Batch.run_id == run_id, Batch.state == BatchState.PENDING)
        if exclude:
            stmt = stmt.where(Batch.id.not_in(exclude))
        ids = list(session.scalars(stmt.order_by(Batch.id).limit(limit)))
        if ids:
            queues.append(ids)
    picked: list[int] = []
    for rank in range(limit):
        layer = sorted(q[rank] for q in queues if rank < len(q))
        if not layer:
            break
        picked.extend(layer)
    return picked[:limit]


def claim_batches(
    session: Session,
    *,
    settings: Settings,
    pool_id: str,
    max_batches: int,
    now: datetime,
    run_ids: Sequence[str] | None = None,
) -> Claim:
    """Lease up to `max_batches` pending batches of the pool's active runs, with their payloads.

    Fair across runs (one flooding run cannot starve another), each run's batches in id
    order. FOR UPDATE SKIP LOCKED: two concurrent claimers never get the same batch.
    `run_ids`: only these runs' batches (a pool with a full buffer claims for its runs that have
    too little); an id that is not one of the pool's claimable runs claims nothing. None: any run.
    """
    expire_leases(session, now=now)
    runs = _claimable_runs(session, pool_id=pool_id)
    if run_ids is not None:
        wanted = set(run_ids)
        runs = [(run_id, slot) for run_id, slot in runs if run_id in wanted]
    slots = dict(runs)
    lease = Claim(lease_expires_at=now + timedelta(seconds=settings.lease_seconds), items=[])
    seen: set[int] = set()
    broken_runs: set[str] = set()
    for _ in range(_CLAIM_ROUNDS):
        run_ids = [run_id for run_id, _slot in runs if run_id not in broken_runs]
        candidates = _fair_candidates(
            session, run_ids=run_ids, limit=max_batches - len(lease.items), exclude=seen
        )
        if not candidates:
            break
        seen.update(candidates)
        locked = _lock_pending(session, candidates)
        for batch in (locked[i] for i in candidates if i in locked):
            if batch.run_id in broken_runs:
                continue
            try:
                payload = read_payload_bytes(settings, batch)
            except PayloadUnreadable as exc:
                # Stop serving this run (its batches are trained in order and this one cannot be),
                # but keep serving every other run.
                log.error("run %s: %s; its batches are held back", batch.run_id, exc.message)
                broken_runs.add(batch.run_id)
                continue
            batch.state = BatchState.CLAIMED
            batch.pool_id = pool_id
            batch.lease_expires_at = lease.lease_expires_at
            batch.claimed_at = now
            lease.items.append(ClaimedItem(batch=batch, slot=slots.get(batch.run_id), payload=payload))
        if len(locked) == len(candidates) or len(lease.items) >= max_batches:
            break
    session.flush()
    return lease


def _lock_pending(session: Session, batch_ids: Sequence[int]) -> dict[int, Batch]:
    """The batches among `batch_ids` still pending, row-locked; those a concurrent claimer holds
    locked are skipped, not waited for."""
    rows = session.scalars(
        select(Batch)
        .where(Batch.id.in_(batch_ids), Batch.state == BatchState.PENDING)
        .with_for_update(skip_locked=True)
        .execution_options(populate_existing=True)
    )
    return {batch.id: batch for batch in rows}


@dataclass(frozen=True)
class AckRequest:
    batch_id: int
    trained_step: int


def _ack_problem(batch: Batch | None, *, pool_id: str, trained_step: int) -> str | None:
    """Why this pool cannot ack this batch with this step (None: it can)."""
    if batch is None:
        return "no such batch"
    if batch.pool_id != pool_id:
        return f"not held by pool {pool_id} (state {batch.state})"
    if batch.state == BatchState.TRAINED and batch.trained_step != trained_step:
        return f"already acked with trained_step {batch.trained_step}"
    if batch.state not in (BatchState.CLAIMED, BatchState.TRAINED):
        return f"not claimed (state {batch.state})"
    return None


def ack_batches(session: Session, *, pool_id: str, acks: Sequence[AckRequest], now: datetime) -> int:
    """Mark batches trained (after the optimizer step that used them). All or nothing: a batch that is
    unknown, or not held by this pool, is a 409 naming it and nothing is acked. Re-acking a batch this
    pool already acked with the same step is a no-op (a retried request). Returns len(acks).
    The pool must be registered and alive (404 pool_not_found, 409 pool_dead / pool_stopped)."""
    get_alive_pool(session, pool_id=pool_id)
    wanted: dict[int, int] = {}
    problems: list[dict[str, object]] = []
    for ack in acks:
        if wanted.setdefault(ack.batch_id, ack.trained_step) != ack.trained_step:
            problems.append({"batch_id": ack.batch_id, "problem": "acked twice with different trained_step"})
    rows = {
        b.id: b
        for b in session.scalars(
            select(Batch).where(Batch.id.in_(wanted)).order_by(Batch.id).with_for_update()
        )
    }
    for batch_id, trained_step in wanted.items():
        problem = _ack_problem(rows.get(batch_id), pool_id=pool_id, trained_step=trained_step)
        if problem is not None:
            problems.append({"batch_id": batch_id, "problem": problem})
    if problems:
        ids = ", ".join(str(p["batch_id"]) for p in problems)
        raise Conflict(f"cannot ack batch(es) {ids}", code="ack_rejected", details=problems)
    for batch_id, trained_step in wanted.items():
        batch = rows[batch_id]
        if batch.state == BatchState.CLAIMED:
            batch.state = BatchState.TRAINED
            batch.trained_step = trained_step
            batch.trained_at = now
            batch.lease_expires_at = None
    session.flush()
    return len(acks)


def _return_after_checkpoint(session: Session, *, run_id: str, checkpoint_step: int) -> list[int]:
    """Every batch of the run that is claimed, or was trained into a step after the checkpoint → pending,
    as if never claimed. Returns their ids in id order."""
    batches = session.scalars(
        select(Batch)
        .where(
            Batch.run_id == run_id,
            or_(
                Batch.state == BatchState.CLAIMED,
                and_(Batch.state == BatchState.TRAINED, Batch.trained_step > checkpoint_step),
            ),
        )
        .order_by(Batch.id)
        .with_for_update()
    ).all()
    for batch in batches:
        batch.state = BatchState.PENDING
        batch.pool_id = None
        batch.lease_expires_at = None
        batch.claimed_at = None
        batch.trained_step = None
        batch.trained_at = None
    return [b.id for b in batches]


def restart_run_from_checkpoint(
    session: Session,
    *,
    run_id: str,
    pool_id: str,
    checkpoint_step: int,
    total_samples: int,
    total_tokens: int,
) -> list[int]:
    """The trainer restarts the run from a checkpoint (DESIGN §4.3): every batch of the run that is claimed,
    or was trained into a step after `checkpoint_step`, goes back to pending, and the run's progress is set
    back to the checkpoint's. Returns the returned batch ids in id order."""
    run = get_run(session, run_id=run_id)
    session.refresh(run, with_for_update=True)
    if run.status != RunStatus.ACTIVE:
        raise Conflict(
            f"run {run_id} is {run.status}; only active runs restart",
            code="run_not_active",
            details={"status": run.status},
        )
    returned = _return_after_checkpoint(session, run_id=run_id, checkpoint_step=checkpoint_step)
    previous = {"step": run.step, "total_samples": run.total_samples, "total_tokens": run.total_tokens}
    run.step = checkpoint_step
    run.total_samples = total_samples
    run.total_tokens = total_tokens
    restored = {"step": checkpoint_step, "total_samples": total_samples, "total_tokens": total_tokens}
    if not returned and previous == restored:
        # The pool calls this on every admission: a run that starts fresh, or resumes exactly where it
        # stood with nothing in flight, restarts nothing, and its feed should not say it did.
        session.flush()
        return returned
    record_event(
        session,
        action="run.restart_from_checkpoint",
        actor="trainer",
        tenant_id=run.tenant_id,
        run_id=run_id,
        details={
            "pool_id": pool_id,
            "checkpoint_step": checkpoint_step,
            "total_samples": total_samples,
            "total_tokens": total_tokens,
            "previous": previous,
            "returned_batches": returned,
        },
    )
    session.flush()
    return returned
