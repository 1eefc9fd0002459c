"""Tinker models nobody drives any more leave their place (the sweeper's job).

A Tinker model is a manual run: it never completes by itself, and no /v1 heartbeat_timeout watches
it. What says a process still drives it is its Tinker session's heartbeat (the SDK sends one every
10 s while its ServiceClient lives). An SDK process killed while its model's run was queued left
that run queued for ever: it took the next slot that freed, within the tenant's quota, and held it
with nobody to use it (probe report, finding 5). Nothing can drive such a model again: the SDK
has no call that attaches a new process to another session's model.

So a model whose session has sent no heartbeat for `Settings.tinker_session_timeout_seconds` (the
process is gone, or closed its ServiceClient, which finishes the session and stops its heartbeats)
is evicted, with a reason naming the session:

- if its run is queued, always: it never trained, and nothing of it is lost;
- if its run is active, unless the model has a live sampler checkpoint: sampling those weights
  (a later `create_sampling_client(model_path=...)`, the usual way to evaluate a finished
  training script's model, as on Tinker) needs the run to stay; the tenant deletes such a run when
  done with it. An evicted model's saved states still load into a new model
  (`create_training_client_from_state`) and its adapters still download (/v1/runs/{id}/adapters).
"""

import logging
from datetime import datetime, timedelta

from sqlalchemy import Select, or_, select
from sqlalchemy.orm import Session

from app.config import Settings
from app.runs import service as runs
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.timestamps import as_utc
from app.tinker.checkpoints import has_sampler_checkpoint
from app.tinker.models import TinkerModel, TinkerSession
from contracts.status import MOVABLE_RUN_STATUSES, RunStatus

log = logging.getLogger(__name__)


def abandoned_query(*, cutoff: datetime) -> Select[str, str, datetime | None]:
    """(run id, session id, session finished_at) of the models to evict: queued or active runs of
    models whose session's last heartbeat is older than `cutoff`, an active one only without a live
    sampler checkpoint; queued runs first (evicting them frees no slot, so no run of this list is
    admitted on the way), then by age."""
    return (
        select(Run.id, TinkerSession.id, TinkerSession.finished_at)
        .join(TinkerModel, TinkerModel.run_id == Run.id)
        .join(TinkerSession, TinkerSession.id == TinkerModel.session_id)
        .where(
            Run.status.in_(MOVABLE_RUN_STATUSES),
            TinkerSession.last_heartbeat_at < cutoff,
            or_(Run.status == RunStatus.QUEUED, ~has_sampler_checkpoint(TinkerModel.id)),
        )
        .order_by((Run.status == RunStatus.ACTIVE), Run.created_at, Run.id)
    )


def eviction_reason(*, session_id: str, finished: bool, timeout_seconds: float) -> str:
    if finished:
        return (
            f"its Tinker session {session_id} was closed (ServiceClient.close) and has sent no "
            f"heartbeat for more than {timeout_seconds:g} s (LORALOOM_TINKER_SESSION_TIMEOUT_SECONDS): "
            "no process drives the model any more"
        )
    return (
        f"its Tinker session {session_id} has sent no heartbeat for more than {timeout_seconds:g} s "
        "(LORALOOM_TINKER_SESSION_TIMEOUT_SECONDS): the SDK process that drove the model is gone"
    )


def evict_abandoned_models(
    session: Session,
    *,
    now: datetime,
    timeout_seconds: float,
    settings: Settings,
    listening_since: datetime | None = None,
) -> list[Run]:
    """Evict the runs of Tinker models whose session stopped heartbeating (module docstring); the
    runs evicted. Never commits. Nothing is due within `timeout_seconds` of `listening_since` (the
    sweeper's start): while the service was down (an upgrade, database maintenance) no heartbeat
    could land, and the SDKs still driving their models send their next one within seconds.

    Race-free against a heartbeat: the candidates are read again under the admission lock with
    their sessions' rows locked (Postgres: FOR UPDATE OF tinker_sessions; a heartbeat updates that
    row, so one committed meanwhile is seen and one arriving now waits for this transaction, and is
    then answered though its model has left: it came after the deadline). SQLite runs one writing
    transaction at a time (BEGIN IMMEDIATE). Against admission and the user's own evict or delete:
    every transition takes the admission lock, and the run is read again under it."""
    cutoff = as_utc(now) - timedelta(seconds=timeout_seconds)
    if listening_since is not None and as_utc(listening_since) > cutoff:
        return []
    query = abandoned_query(cutoff=cutoff)
    if session.execute(query.limit(1)).first() is None:
        return []  # the common case takes no lock (the sweeper calls this every few seconds)
    lock_admission(session)
    due = session.execute(query.with_for_update(of=TinkerSession)).tuples().all()
    evicted: list[Run] = []
    for run_id, session_id, finished_at in due:
        run = runs.get_run(session, run_id=run_id)
        reason = eviction_reason(
            session_id=session_id, finished=finished_at is not None, timeout_seconds=timeout_seconds
        )
        runs.evict_run(
            session, run=run, reason=reason, evicted_by="heartbeat", actor="heartbeat", settings=settings
        )
        evicted.append(run)
    if evicted:
        log.info("tinker: evicted %d run(s) of models whose sessions went silent", len(evicted))
    return evicted
