"""The leases of claimed batches: how a claim ends other than by an ack.

A claim lasts `lease_seconds`. The pool's heartbeat extends it; it runs out (the sweeper and every
claim expire leases), or the pool that holds it dies or is replaced (its batches return at once).
Each way puts the batch back to pending, to be claimed again in id order. These functions touch
batch rows only, so the pools service and the sweeper use them without importing the batch service.
"""

import logging
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Update, update
from sqlalchemy.orm import Session

from app.batches.models import Batch
from app.config import Settings
from app.db import rows_changed
from contracts.status import BatchState

log = logging.getLogger("loraloom.batches")

DEFAULT_LEASE_SECONDS: float = Settings.model_fields["lease_seconds"].default
"""Used by `extend_leases` when the caller does not pass the configured lease length."""


def _release(*conditions: ColumnElement[bool]) -> Update:
    """Claimed batches matching `conditions` → pending, held by no pool."""
    return (
        update(Batch)
        .where(Batch.state == BatchState.CLAIMED, *conditions)
        .values(state=BatchState.PENDING, pool_id=None, lease_expires_at=None, claimed_at=None)
        .execution_options(synchronize_session=False)
    )


def expire_leases(session: Session, *, now: datetime) -> int:
    """Claimed batches whose lease ran out → pending. Returns how many."""
    expired = rows_changed(session, _release(Batch.lease_expires_at < now))
    if expired:
        log.info("%s batch lease(s) expired; returned to pending", expired)
    return expired


def return_pool_batches(session: Session, *, pool_id: str) -> int:
    """Every batch a (dead or replaced) pool holds → pending. Returns how many."""
    return rows_changed(session, _release(Batch.pool_id == pool_id))


def extend_leases(
    session: Session, *, pool_id: str, now: datetime, lease_seconds: float = DEFAULT_LEASE_SECONDS
) -> int:
    """Push the lease of every batch the pool holds to now + lease_seconds (pool heartbeat). Returns how many."""
    return rows_changed(
        session,
        update(Batch)
        .where(Batch.state == BatchState.CLAIMED, Batch.pool_id == pool_id)
        .values(lease_expires_at=now + timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False),
    )
