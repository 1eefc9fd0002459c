"""Postgres: the pending count, the run-row update and the batch insert of an ingestion in ONE statement.

A data-modifying CTE takes the run row lock and reserves the batch's sample range (`UPDATE runs …
RETURNING`), counts the run's unclaimed batches, and inserts the batch row from that range in the
same round trip, but only when the run, as just locked, still takes the batch (active, not too
stale) and the pending limits leave room: the caller then checks the returned counts and run state
exactly as the statement-by-statement path does (service._add_row) and raises its error, whose
rollback undoes the reservation. The count comes from the statement's snapshot (taken before the
lock was granted), as an unlocked read would: a flood guard, not an invariant.
`ON CONFLICT (run_id, idempotency_key) DO NOTHING` leaves `batch_id` NULL for a repeated key; the
caller gives the range back then (the rare path).

The same statement reads the batch's rollout step's stats row (app/rollouts/service.add_batch
merges into it), saving that read's round trip, but the row comes from the statement's snapshot,
which misses what a submission that held the run row lock before us committed. It can be trusted
only when no such submission committed: every writer of a run's stats rows raises the run's
`submitted_samples` in the same transaction under the same lock (only ingestion writes them, and
`submitted_samples` never goes down across transactions), so the snapshot is current exactly when
the locked row's count is the snapshot's plus this batch's (`stats_current`); otherwise the caller
reads the row again under the lock.
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Connection, text

from app.db import pg_execute
from app.errors import NotFound
from app.rollouts.service import StepStats
from contracts.status import BatchState, RunStatus

_STATEMENT = text(
    """
WITH locked AS (
    UPDATE runs SET submitted_samples = submitted_samples + :num_samples
    WHERE id = :run_id
    RETURNING submitted_samples, status, step, eviction_reason, evicted_by
), pending AS (
    SELECT count(*) AS batches, coalesce(sum(payload_bytes), 0) AS bytes
    FROM batches WHERE run_id = :run_id AND state = :pending
), inserted AS (
    INSERT INTO batches (run_id, idempotency_key, request_hash, rollout_step, num_samples, num_tokens,
                         sample_offset, payload_path, payload_bytes, payload_sha256, state, created_at,
                         reward_count, reward_mean, reward_m2, reward_min, reward_max)
    SELECT :run_id, :idempotency_key, :request_hash, :rollout_step, :num_samples, :num_tokens,
           locked.submitted_samples - :num_samples, :payload_path, :payload_bytes, :payload_sha256,
           :state, :created_at, :reward_count, :reward_mean, :reward_m2, :reward_min, :reward_max
    FROM locked, pending
    WHERE locked.status = :active AND locked.step - :rollout_step <= :max_async_level
      AND pending.batches < :max_pending_batches AND pending.bytes + :payload_bytes <= :max_pending_bytes
    ON CONFLICT (run_id, idempotency_key) DO NOTHING
    RETURNING id
), snapshot AS (
    SELECT submitted_samples FROM runs WHERE id = :run_id
), step_stats AS (
    SELECT id, samples, reward_count, reward_mean, reward_m2, reward_min, reward_max, metrics
    FROM rollout_stats WHERE run_id = :run_id AND rollout_step = :rollout_step
)
SELECT locked.submitted_samples, locked.status, locked.step, locked.eviction_reason, locked.evicted_by,
       pending.batches AS pending_batches, pending.bytes AS pending_bytes,
       (SELECT id FROM inserted) AS batch_id,
       snapshot.submitted_samples = locked.submitted_samples - :num_samples AS stats_current,
       step_stats.id AS stats_id, step_stats.samples AS stats_samples,
       step_stats.reward_count AS stats_reward_count, step_stats.reward_mean AS stats_reward_mean,
       step_stats.reward_m2 AS stats_reward_m2, step_stats.reward_min AS stats_reward_min,
       step_stats.reward_max AS stats_reward_max, step_stats.metrics AS stats_metrics
FROM locked CROSS JOIN pending CROSS JOIN snapshot LEFT JOIN step_stats ON true
"""
).columns(stats_metrics=JSON)  # decoded as the ORM's column is


@dataclass(frozen=True)
class Reserved:
    submitted_samples: int
    status: str
    step: int
    eviction_reason: str | None
    evicted_by: str | None
    pending_batches: int
    """Unclaimed batches of the run before this one."""
    pending_bytes: int
    inserted: tuple[int, datetime] | None
    """The new row's id and creation time, or None: the run or the limits refused it, or the key existed."""
    step_stats: "StepStatsRead"
    """The batch's rollout-step stats row as the statement read it (see the module's docstring)."""


@dataclass(frozen=True)
class StepStatsRead:
    current: bool
    """False: a submission committed between the snapshot and the lock; read the row again."""
    row: StepStats | None
    """None: the step has no row yet."""


def reserve_and_insert(
    connection: Connection,
    *,
    values: dict[str, object],
    max_async_level: int,
    max_pending_batches: int,
    max_pending_bytes: int,
) -> Reserved:
    """`values`: the batch row's columns except `sample_offset` (`state` is pending), its reward
    summary (`reward_count` ... `reward_max`) included."""
    assert values["state"] == BatchState.PENDING.value
    # On the psycopg connection directly, prepared (app/db.py pg_execute).
    row = pg_execute(
        connection,
        _STATEMENT,
        values
        | {
            "pending": BatchState.PENDING.value,
            "active": RunStatus.ACTIVE.value,
            "max_async_level": max_async_level,
            "max_pending_batches": max_pending_batches,
            "max_pending_bytes": max_pending_bytes,
        },
    )
    if row is None:  # the run was deleted with its tenant since it was read
        raise NotFound(f"run {values['run_id']} not found")
    created_at = values["created_at"]
    assert isinstance(created_at, datetime)
    (submitted, status, step, eviction_reason, evicted_by, pending_batches, pending_bytes, batch_id) = row[:8]
    stats_current, *stats = row[8:]
    return Reserved(
        submitted,
        status,
        step,
        eviction_reason,
        evicted_by,
        int(pending_batches),
        int(pending_bytes),
        None if batch_id is None else (batch_id, created_at),
        StepStatsRead(bool(stats_current), _stats_row(stats)),
    )


def _stats_row(columns: list[Any]) -> StepStats | None:
    """The step_stats columns of the statement's row, in its order."""
    return None if columns[0] is None else StepStats(*columns)
