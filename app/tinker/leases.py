"""The pool's hold on Tinker work, and how long done work is kept.

A claimed future is held by the pool that claimed it (`pool_id`) for as long as that pool is
alive: its lease is the pool's own heartbeat. Unlike a rollout batch, manual work is not handed
to another pool while its holder lives: the run's accumulated gradients are in that pool's memory,
and there is one pool per base model. When the pool dies, stops or is replaced, its running futures
return to pending (here), and the complete forward_backward / load_weights futures whose effect
only it held are replayed by the next pool (app.tinker.work.claim). These functions touch
tinker_futures rows only, so the pools service and the sweeper use them without the Tinker service.
"""

import logging
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Text, cast, delete, or_, update
from sqlalchemy.orm import Session

from app.db import rows_changed
from app.tinker.models import TinkerFuture

log = logging.getLogger("loraloom.tinker")

RUNNING = "running"
KEPT_KINDS = ("create_model", "save_weights", "save_weights_for_sampler")
"""Futures that are the record of a model or of saved weights (`tinker://` paths resolve through
them): never purged, they live as long as their model."""


def request_cleared() -> ColumnElement[bool]:
    """The future's request is gone: SQL NULL, or the JSON null an ORM assignment of None stores."""
    return or_(TinkerFuture.request.is_(None), cast(TinkerFuture.request, Text) == "null")


def return_pool_work(session: Session, *, pool_id: str) -> int:
    """Every future a (dead, stopped or replaced) pool was running → pending. Returns how many.

    Its late results are refused from now on (app.tinker.work.record_results)."""
    returned = rows_changed(
        session,
        update(TinkerFuture)
        .where(TinkerFuture.status == RUNNING, TinkerFuture.pool_id == pool_id)
        .values(status="pending", pool_id=None)
        .execution_options(synchronize_session=False),
    )
    if returned:
        log.info("pool %s: %s Tinker request(s) returned to pending", pool_id, returned)
    return returned


def purge_done_futures(session: Session, *, now: datetime, ttl_seconds: float) -> int:
    """Delete the futures done (complete or failed) more than `ttl_seconds` ago. Returns how many.

    Kept: the records in KEPT_KINDS, and a future whose request is still needed to rebuild its
    run's current step after a pool crash (its request is cleared at the run's next optim_step)."""
    purged = rows_changed(
        session,
        delete(TinkerFuture)
        .where(
            TinkerFuture.status.in_(("complete", "failed")),
            TinkerFuture.completed_at < now - timedelta(seconds=ttl_seconds),
            TinkerFuture.kind.not_in(KEPT_KINDS),
            request_cleared(),
        )
        .execution_options(synchronize_session=False),
    )
    if purged:
        log.info("%s done Tinker future(s) older than %ss purged", purged, ttl_seconds)
    return purged
