"""Rollout batches from the tenant's side: validated, durable ingestion, and listing.

Ingestion (DESIGN §4.3, §4.4): a batch is decoded, validated whole (one bad sample
rejects it, nothing stored), written as a file (atomic, fsynced) and only then gets
its row; the session dependency commits before the 201 is sent. The run row is
locked (an UPDATE of its `submitted_samples`, held to the commit) while the row is
added, so concurrent submissions get disjoint `sample_offset`s, and the insert is
`ON CONFLICT (run_id, idempotency_key) DO NOTHING`, so a repeated Idempotency-Key
finds the first batch instead of storing a second one.

The pool's side (claims, acks, restarts) is in claims.py.
"""

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import Insert, func, select, update
from sqlalchemy.orm import Session
from starlette.datastructures import State

from app.batches.ingest import ingest, request_digest
from app.batches.ingest_run import IngestRun, vocab_size_query
from app.batches.models import Batch
from app.batches.one_statement import reserve_and_insert
from app.batches.storage import StoredPayload, discard_payload, write_payload
from app.config import Settings
from app.db import conflict_insert, utcnow
from app.errors import AppError, Conflict, NotFound, RateLimited
from app.limits import PENDING_RETRY_AFTER_SECONDS
from app.projection import remove_run_dir
from app.rollouts.service import add_batch as add_rollout_batch
from app.rollouts.service import batch_rewards
from app.runs.models import Run
from app.ttl_cache import TtlCache, state_cache
from contracts.arrays import ArrayBatch, num_tokens
from contracts.run_config import RunConfig
from contracts.status import BatchState, RunStatus


@dataclass(frozen=True)
class StoredBatch:
    """A batch row just inserted, as the response shows it (no ORM object on the hot path)."""

    id: int
    run_id: str
    rollout_step: int
    num_samples: int
    num_tokens: int
    state: BatchState
    trained_step: int | None
    created_at: datetime


@dataclass(frozen=True)
class SubmitResult:
    batch: StoredBatch | Batch
    """The new row, or on a replay the earlier request's (an ORM object: the rare path)."""
    created: bool
    """False on an idempotent replay (the batch stored by an earlier request with the same key)."""


def vocab_size_for(session: Session, *, base_model: str) -> int | None:
    """The vocabulary size of `base_model` as reported by its pool (the live one first); None if no pool
    ever registered for it (token ids are then only checked to be non-negative)."""
    return session.scalar(select(vocab_size_query(base_model)))


# --------------------------------------------------------------------------- ingestion


def run_config(stored: dict[str, Any]) -> RunConfig:
    """A run's stored config, validated. Memoised by its content (validating it is ~0.4 ms, a
    tenth of a batch's service CPU, and a run's config is the same for every batch it takes)."""
    return _validated_config(json.dumps(stored, sort_keys=True))


@lru_cache(maxsize=1024)
def _validated_config(canonical: str) -> RunConfig:
    # RunConfig is frozen, so one instance serves every thread.
    return RunConfig.model_validate(json.loads(canonical))


@dataclass(frozen=True)
class _RunState:
    """What decides whether a run takes a batch (read once, then again under the row lock)."""

    id: str
    status: str
    step: int
    eviction_reason: str | None
    evicted_by: str | None

    @classmethod
    def of(cls, run: IngestRun) -> "_RunState":
        return cls(run.id, run.status, run.step, run.eviction_reason, run.evicted_by)


class RunIsManual(Conflict):
    """A Tinker model's run (`config.mode` manual): its user steps it with forward_backward and
    optim_step, so a rollout batch trained into it would apply (and use up) gradients the user
    accumulated for their own next step."""

    code = "run_is_manual"

    def __init__(self, run_id: str) -> None:
        super().__init__(
            f"run {run_id} is driven through the Tinker API (mode manual); it takes no rollout batches",
            details={"mode": "manual"},
        )


RUN_MOVED = frozenset({"run_evicted", "run_not_active", "stale_batch"})
"""The refusals that say the run left or trained past the batch since it was read."""


FullRuns = TtlCache[str, bool]
"""Run ids whose last batch was refused because their unclaimed batches were at the limits."""

FULL_RUN_MEMORY_SECONDS = 60.0
"""How long a run refused for its pending limits gets the early check (then one batch again pays for
its decode and payload write before the statement refuses it, and marks the run again)."""


def full_runs(state: State) -> FullRuns:
    """The app's runs refused at their pending limits (see `_refuse_if_still_full`)."""
    runs: FullRuns = state_cache(state, "full_runs", FULL_RUN_MEMORY_SECONDS)
    return runs


def _check_status(run: _RunState) -> None:
    if run.status == RunStatus.EVICTED:
        raise Conflict(
            f"run {run.id} was evicted by {run.evicted_by}: {run.eviction_reason}",
            code="run_evicted",
            details={"reason": run.eviction_reason, "evicted_by": run.evicted_by},
        )
    if run.status != RunStatus.ACTIVE:
        raise Conflict(
            f"run {run.id} is {run.status}; only active runs take batches",
            code="run_not_active",
            details={"status": run.status},
        )


def _check_fresh(run: _RunState, batch: ArrayBatch, config: RunConfig) -> None:
    lag = run.step - batch.step
    if lag > config.max_async_level:
        raise Conflict(
            f"batch sampled at step {batch.step} lags the run's trained step {run.step} by {lag} "
            f"(> max_async_level {config.max_async_level}); sample with a newer adapter",
            code="stale_batch",
            details={
                "rollout_step": batch.step,
                "run_step": run.step,
                "max_async_level": config.max_async_level,
            },
        )


def _replay(session: Session, *, run_id: str, idempotency_key: str, request_hash: str) -> Batch | None:
    """The batch an earlier request with this key stored, or None; 409 if that request's body differed."""
    existing = session.scalar(
        select(Batch).where(Batch.run_id == run_id, Batch.idempotency_key == idempotency_key)
    )
    if existing is not None and existing.request_hash != request_hash:
        raise Conflict(
            f"Idempotency-Key {idempotency_key!r} was already used for a different batch of run {run_id}",
            code="idempotency_conflict",
            details={"batch_id": existing.id},
        )
    return existing


def _earlier_if_refused_early(
    session: Session,
    settings: Settings,
    run: _RunState,
    *,
    full: FullRuns,
    idempotency_key: str | None,
    body: bytes,
    msgpack: bool,
) -> Batch | None:
    """None if the run may take the batch; else the batch an earlier request with this key and body
    stored (a retry of a request accepted before the run stopped or filled up gets its batch back), or
    the refusal: the run's 409, or the 429 of a run still at its pending limits (`_refuse_if_still_full`)."""
    try:
        _check_status(run)
        _refuse_if_still_full(session, settings=settings, run_id=run.id, full=full)
    except (Conflict, RateLimited):
        if idempotency_key is not None and (
            existing := _replay_of_body(
                session, run_id=run.id, idempotency_key=idempotency_key, body=body, msgpack=msgpack
            )
        ):
            return existing
        raise
    return None


def _replay_of_body(
    session: Session, *, run_id: str, idempotency_key: str, body: bytes, msgpack: bool
) -> Batch | None:
    """The batch an earlier request with this key and body stored (None also for an undecodable body)."""
    digest = request_digest(body, msgpack=msgpack)
    if digest is None:
        return None
    return _replay(session, run_id=run_id, idempotency_key=idempotency_key, request_hash=digest)


@lru_cache(maxsize=4)
def _insert_new_stmt(dialect: str) -> Insert:
    return (
        conflict_insert(dialect, Batch)
        .on_conflict_do_nothing(index_elements=["run_id", "idempotency_key"])
        .returning(Batch.id, Batch.created_at)
    )


def _insert_new(session: Session, values: dict[str, object]) -> tuple[int, datetime] | None:
    """INSERT … ON CONFLICT (run_id, idempotency_key) DO NOTHING RETURNING: the new row's id and
    creation time, or None if a batch with this key exists (then nothing was written)."""
    stmt = _insert_new_stmt(session.get_bind().dialect.name)  # built once: this is the hot path
    row = session.connection().execute(stmt, values).one_or_none()
    return None if row is None else (row.id, row.created_at)


def submit_batch(
    session: Session,
    *,
    settings: Settings,
    run: IngestRun,
    body: bytes,
    msgpack: bool,
    idempotency_key: str | None,
    full: FullRuns,
) -> SubmitResult:
    """Validate and store one rollout batch (a TrainingBatch, JSON or msgpack `body`) of `run`.

    Raises Conflict (run_is_manual, run_evicted, run_not_active, stale_batch, idempotency_conflict) or
    ValidationFailed (details: [{loc, msg, type, sample, field, problem}]); nothing is stored then. A request
    repeating an earlier Idempotency-Key and body returns the earlier batch (created=False),
    whatever happened to the run since; a manual run's refusal comes first (its mode never changes:
    only a batch stored before such runs were refused could be replayed, and it is not).
    """
    state = _RunState.of(run)
    config = run_config(run.config)
    if config.mode == "manual":
        # From the config already in hand (the route's cached read): no statement spent. It never
        # changes, so it comes first, whatever the run's state or the body.
        raise RunIsManual(run.id)
    if state.status == RunStatus.ACTIVE and full.get(run.id) is not None:
        # A run marked full answers 429 before the body is decoded (`_refuse_if_still_full`), and that
        # 429 lasts until the pool claims its batches: a client told 429 retries, so a batch that can
        # never be stored would be retried as long, never told what is wrong with it. Its 422 comes
        # first. The body is in hand already (both routes read it before calling here): this costs a
        # decode, not the payload's write and fsync that the early 429 spares a run at its limits. A
        # run that moved keeps its 409 first (it will not take the batch, whatever it holds).
        ingest(body, msgpack=msgpack, seq_len=config.seq_len, vocab_size=run.vocab_size)
    earlier = _earlier_if_refused_early(
        session, settings, state, full=full, idempotency_key=idempotency_key, body=body, msgpack=msgpack
    )
    if earlier is not None:
        return SubmitResult(earlier, created=False)
    ingested = ingest(body, msgpack=msgpack, seq_len=config.seq_len, vocab_size=run.vocab_size)
    batch, data, digest = ingested.batch, ingested.data, ingested.sha256
    try:
        _check_fresh(state, batch, config)
    except Conflict:
        if idempotency_key is not None:
            existing = _replay(session, run_id=run.id, idempotency_key=idempotency_key, request_hash=digest)
            if existing is not None:
                return SubmitResult(existing, created=False)
        raise

    # The file goes first and outside the run lock (its name does not depend on the offset):
    # a crash before the commit leaves an unreferenced file, never a row without a file.
    # The reads so far end here, so the connection goes back to the pool while the file is
    # written and fsynced (_add_row re-reads the run under its lock). A run from the route's
    # cache read nothing: no transaction to end (an empty commit still costs ~0.1 ms).
    if session.in_transaction():
        session.commit()
    stored = write_payload(settings, run_id=run.id, rollout_step=batch.step, data=data, sha256=digest)
    stored.release_when_transaction_ends(session)  # the start-up clean-up skips it until then
    try:
        result = _add_row(
            session,
            settings=settings,
            run=run,
            batch=batch,
            config=config,
            stored=stored,
            idempotency_key=idempotency_key,
        )
    except (Conflict, RateLimited, NotFound) as refusal:
        discard_payload(settings, stored.relative_path)
        return _earlier_or_raise(
            session,
            settings,
            run_id=run.id,
            refusal=refusal,
            idempotency_key=idempotency_key,
            digest=digest,
            full=full,
        )
    except BaseException:
        discard_payload(settings, stored.relative_path)
        raise
    if not result.created:  # the earlier request's file holds this batch
        discard_payload(settings, stored.relative_path)
    return result


def _earlier_or_raise(
    session: Session,
    settings: Settings,
    *,
    run_id: str,
    refusal: AppError,
    idempotency_key: str | None,
    digest: str,
    full: FullRuns,
) -> SubmitResult:
    """After the row's statement refused the batch (its file already discarded): the batch this
    request's key stored before, or the refusal raised."""
    if _run_gone(refusal):  # deleted while the file was written: its path may have been made again
        remove_run_dir(run_id, settings)
    if isinstance(refusal, RateLimited):
        full.put(run_id, True)  # its next batches are counted before they are written
    # The run moved or filled up after it was read (a cached read may be seconds old:
    # app/batches/ingest_run.py): a retry of a request it accepted before still gets its batch.
    if idempotency_key is None or refusal.code not in RUN_MOVED | {RateLimited.code}:
        raise refusal
    session.rollback()  # the statement's reservation
    existing = _replay(session, run_id=run_id, idempotency_key=idempotency_key, request_hash=digest)
    if existing is None:
        raise refusal
    return SubmitResult(existing, created=False)


def _run_gone(refusal: AppError) -> bool:
    """Whether the statement refused the batch because the run was deleted (alone, or with its
    tenant: no row left)."""
    if isinstance(refusal, NotFound):
        return True
    details = refusal.details if isinstance(refusal.details, dict) else {}
    return refusal.code == "run_not_active" and details.get("status") == RunStatus.DELETED


def _pending_of(session: Session, run_id: str) -> tuple[int, int]:
    """The run's unclaimed batches and the bytes of their payloads."""
    count, size = session.execute(
        select(func.count(), func.coalesce(func.sum(Batch.payload_bytes), 0)).where(
            Batch.run_id == run_id, Batch.state == BatchState.PENDING
        )
    ).one()
    return int(count), int(size)


def _refuse_if_still_full(session: Session, *, settings: Settings, run_id: str, full: FullRuns) -> None:
    """The 429 before the decode and the payload write, for a run whose last batch the pending limits
    refused and which has no room for any batch still (a client retrying at its limit would otherwise
    make the service decode, write and fsync every attempt). The limits are checked exactly under the
    run row lock as ever; this only answers earlier, and costs one read only while the run is marked."""
    if full.get(run_id) is None:
        return
    pending_batches, pending_bytes = _pending_of(session, run_id)
    if pending_batches < settings.run_max_pending_batches and pending_bytes < settings.run_max_pending_bytes:
        full.pop(run_id)  # room again (a batch that does not fit still meets the exact check)
        return
    _check_pending_room(
        settings, run_id=run_id, pending_batches=pending_batches, pending_bytes=pending_bytes, adding_bytes=1
    )


def _check_pending_room(
    settings: Settings, *, run_id: str, pending_batches: int, pending_bytes: int, adding_bytes: int
) -> None:
    """429 if the run's unclaimed batches are at their limits (a flood guard; see _add_row)."""
    if (
        pending_batches + 1 > settings.run_max_pending_batches
        or pending_bytes + adding_bytes > settings.run_max_pending_bytes
    ):
        raise RateLimited(
            f"run {run_id} has {pending_batches} unclaimed batches ({pending_bytes} bytes); the limits are "
            f"{settings.run_max_pending_batches} batches and {settings.run_max_pending_bytes} bytes. "
            "Retry once the pool has claimed some",
            details={
                "kind": "pending_batches",
                "pending_batches": pending_batches,
                "pending_bytes": pending_bytes,
                "max_pending_batches": settings.run_max_pending_batches,
                "max_pending_bytes": settings.run_max_pending_bytes,
            },
            retry_after=PENDING_RETRY_AFTER_SECONDS,
        )


def _add_row(
    session: Session,
    *,
    settings: Settings,
    run: IngestRun,
    batch: ArrayBatch,
    config: RunConfig,
    stored: StoredPayload,
    idempotency_key: str | None,
) -> SubmitResult:
    """The batch's row, under the run row lock; or, if a batch with this key was stored meanwhile, that one.

    The pending count is read without the run row lock (in the same statement as the lock on
    Postgres, so from the snapshot taken before it), so concurrent submissions may pass the limit
    by a batch each: it is a flood guard, not an invariant."""
    num_samples, tokens = len(batch.examples), num_tokens(batch)
    run_id = run.id
    # Computed once: the row keeps it (a trainer step's exact `trained_reward`) and its rollout
    # step's stats merge it (add_rollout_batch).
    rewards = batch_rewards(batch)
    values: dict[str, object] = {
        "run_id": run_id,
        "idempotency_key": idempotency_key,
        "request_hash": stored.sha256,
        "rollout_step": batch.step,
        "num_samples": num_samples,
        "num_tokens": tokens,
        "payload_path": stored.relative_path,
        "payload_bytes": stored.size_bytes,
        "payload_sha256": stored.sha256,
        "state": BatchState.PENDING.value,
        "created_at": utcnow(),
        "reward_count": rewards.count,
        "reward_mean": rewards.mean,
        "reward_m2": rewards.m2,
        "reward_min": rewards.min,
        "reward_max": rewards.max,
    }
    if session.get_bind().dialect.name == "postgresql":
        # One round trip: the pending count, the range reserved under the run row lock, and the
        # insert (one_statement.py); a refusal below rolls the reservation back.
        reserved = reserve_and_insert(
            session.connection(),
            values=values,
            max_async_level=config.max_async_level,
            max_pending_batches=settings.run_max_pending_batches,
            max_pending_bytes=settings.run_max_pending_bytes,
        )
        _check_pending_room(
            settings,
            run_id=run_id,
            pending_batches=reserved.pending_batches,
            pending_bytes=reserved.pending_bytes,
            adding_bytes=stored.size_bytes,
        )
        state = _RunState(
            run_id, reserved.status, reserved.step, reserved.eviction_reason, reserved.evicted_by
        )
        _check_status(state)  # the run may have moved while the file was written (rollback: no range taken)
        _check_fresh(state, batch, config)
        inserted = reserved.inserted
        # The step's stats row came with the statement when its snapshot is current (one_statement.py).
        step_stats = (reserved.step_stats.row,) if reserved.step_stats.current else None
    else:
        inserted = _reserve_then_insert(
            session, settings=settings, run_id=run_id, batch=batch, config=config, values=values
        )
        step_stats = None
    if inserted is not None:
        batch_id, created_at = inserted
        add_rollout_batch(
            session,
            run_id=run_id,
            tenant_id=run.tenant_id,
            batch_id=batch_id,
            batch=batch,
            step_stats=step_stats,
            rewards=rewards,
        )
        row = StoredBatch(
            id=batch_id,
            run_id=run_id,
            rollout_step=batch.step,
            num_samples=num_samples,
            num_tokens=tokens,
            state=BatchState.PENDING,
            trained_step=None,
            created_at=created_at,
        )
        return SubmitResult(row, created=True)
    # An earlier request with this key (a retry, or a concurrent twin that committed while we
    # waited for the lock): give back the sample range, answer with its batch.
    assert idempotency_key is not None  # rows without a key never conflict
    session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(submitted_samples=Run.submitted_samples - num_samples)
        .execution_options(synchronize_session=False)
    )
    existing = _replay(session, run_id=run_id, idempotency_key=idempotency_key, request_hash=stored.sha256)
    if existing is None:  # pragma: no cover - the conflict says it exists
        raise RuntimeError("idempotency conflict without a batch")
    return SubmitResult(existing, created=False)


def _reserve_then_insert(
    session: Session,
    *,
    settings: Settings,
    run_id: str,
    batch: ArrayBatch,
    config: RunConfig,
    values: dict[str, object],
) -> tuple[int, datetime] | None:
    """The statement-by-statement form (SQLite): the pending count, the run-row UPDATE, the
    checks, then the INSERT."""
    count, size = _pending_of(session, run_id)
    adding = values["payload_bytes"]
    assert isinstance(adding, int)
    _check_pending_room(
        settings, run_id=run_id, pending_batches=count, pending_bytes=size, adding_bytes=adding
    )
    num_samples = len(batch.examples)
    # One statement takes the run row lock (held to the commit, so concurrent submissions get
    # disjoint offsets), reserves this batch's sample range and re-reads the run's state.
    locked = session.execute(
        update(Run)
        .where(Run.id == run_id)
        .values(submitted_samples=Run.submitted_samples + num_samples)
        .returning(Run.submitted_samples, Run.status, Run.step, Run.eviction_reason, Run.evicted_by)
        .execution_options(synchronize_session=False)
    ).one_or_none()
    if locked is None:  # deleted with its tenant since it was read
        raise NotFound(f"run {run_id} not found")
    state = _RunState(run_id, locked.status, locked.step, locked.eviction_reason, locked.evicted_by)
    _check_status(state)  # the run may have moved while the file was written
    _check_fresh(state, batch, config)
    return _insert_new(session, values | {"sample_offset": locked.submitted_samples - num_samples})


def list_batches(
    session: Session,
    *,
    run_id: str,
    state: BatchState | None = None,
    limit: int = 50,
    cursor: int | None = None,
) -> tuple[list[Batch], int | None]:
    """The run's batches in id order, after `cursor` (a batch id); returns (page, next cursor or None)."""
    stmt = select(Batch).where(Batch.run_id == run_id)
    if state is not None:
        stmt = stmt.where(Batch.state == state)
    if cursor is not None:
        stmt = stmt.where(Batch.id > cursor)
    rows = list(session.scalars(stmt.order_by(Batch.id).limit(limit + 1)))
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, rows[-1].id
