"""Postgres: the run-row update and the batch insert of an ingestion in ONE statement.

A data-modifying CTE takes the run row lock and reserves the batch's sample range (`UPDATE runs …
RETURNING`), and inserts the batch row from that range in the same round trip, but only when the run,
as just locked, still takes the batch (active, not too stale): the caller then checks the returned run
state exactly as the two-statement path does (service._add_row) and raises its Conflict, whose
rollback undoes the reservation. `ON CONFLICT (run_id, idempotency_key) DO NOTHING` leaves
`batch_id` NULL for a repeated key; the caller gives the range back then (the rare path).
"""

from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import text
from sqlalchemy.orm import Session, make_transient_to_detached

from app.batches.models import Batch
from app.db import utcnow
from contracts.status import BatchState, RunStatus

_STATEMENT = text(
    """
WITH locked AS (
    UPDATE runs SET submitted_samples = submitted_samples + :num_samples
    WHERE id = :run_id
    RETURNING submitted_samples, status, step, eviction_reason, evicted_by
), inserted AS (
    INSERT INTO batches (run_id, idempotency_key, request_hash, rollout_step, num_samples, num_tokens,
                         sample_offset, payload_path, payload_bytes, payload_sha256, state, created_at)
    SELECT :run_id, :idempotency_key, :request_hash, :rollout_step, :num_samples, :num_tokens,
           locked.submitted_samples - :num_samples, :payload_path, :payload_bytes, :payload_sha256,
           :state, :created_at
    FROM locked
    WHERE locked.status = :active AND locked.step - :rollout_step <= :max_async_level
    ON CONFLICT (run_id, idempotency_key) DO NOTHING
    RETURNING id
)
SELECT locked.submitted_samples, locked.status, locked.step, locked.eviction_reason, locked.evicted_by,
       (SELECT id FROM inserted) AS batch_id
FROM locked
"""
)


@dataclass(frozen=True)
class Reserved:
    submitted_samples: int
    status: str
    step: int
    eviction_reason: str | None
    evicted_by: str | None
    batch: Batch | None
    """The new row (attached to the session), or None: the run refused it or the key existed."""


def reserve_and_insert(session: Session, *, values: dict[str, object], max_async_level: int) -> Reserved:
    """`values`: the batch row's columns except `sample_offset`, `state` and `created_at`."""
    created_at: datetime = utcnow()
    row = session.execute(
        _STATEMENT,
        values
        | {
            "state": BatchState.PENDING.value,
            "created_at": created_at,
            "active": RunStatus.ACTIVE.value,
            "max_async_level": max_async_level,
        },
    ).one()
    batch = None
    if row.batch_id is not None:
        batch = Batch(
            id=row.batch_id,
            sample_offset=row.submitted_samples - int(cast(int, values["num_samples"])),
            state=BatchState.PENDING,
            created_at=created_at,
            pool_id=None,
            lease_expires_at=None,
            trained_step=None,
            claimed_at=None,
            trained_at=None,
            **cast(dict[str, Any], values),
        )
        # The row exists (inserted above): attach the object as persistent, without a second INSERT.
        make_transient_to_detached(batch)
        session.add(batch)
    return Reserved(row.submitted_samples, row.status, row.step, row.eviction_reason, row.evicted_by, batch)
