"""Tinker sessions, training models (each one a loraloom run in manual mode) and futures."""

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.db import Base, utcnow

CHECKPOINT_DELETED = "loraloom_deleted"
"""Set in a save's result when the user deletes the checkpoint it named (the future itself stays:
it answers a retried request with the same seq_id). Keys prefixed `loraloom_` never reach the SDK."""


REPLAYED_KINDS = ("forward_backward", "load_weights")
"""Done requests whose effect lives in the pool's memory until the run's next optim_step is
checkpointed: the accumulated gradient, the loaded weights."""


def claimable(table: str = "") -> str:
    """The predicate of `CLAIMABLE`, its columns prefixed with ``table.`` if given."""
    t = f"{table}." if table else ""
    kinds = ", ".join(f"'{k}'" for k in REPLAYED_KINDS)
    return (
        f"{t}status = 'pending' OR ({t}status = 'complete' AND {t}kind IN ({kinds}) "
        f"AND {t}request IS NOT NULL AND CAST({t}request AS TEXT) <> 'null')"
    )


def unfinished(table: str = "") -> str:
    """The predicate of the partial index `ix_tinker_futures_unfinished`: work not yet done (its
    request stored, and counted against the tenant's bounds: app.tinker.work.check_pending_room)."""
    t = f"{table}." if table else ""
    return f"{t}status IN ('pending', 'running')"


SAVE_KINDS = ("save_weights", "save_weights_for_sampler")
"""Requests whose completed result names a checkpoint path (app.tinker.checkpoints)."""


def current_saves(table: str = "") -> str:
    """The predicate of the partial index `ix_tinker_futures_current_saves`: completed saves no newer
    save of their path has superseded, the newest save of each path (`TinkerFuture.superseded_at`).
    Said literally in the queries that read the index, as `CLAIMABLE` is."""
    t = f"{table}." if table else ""
    kinds = ", ".join(f"'{k}'" for k in SAVE_KINDS)
    return f"{t}kind IN ({kinds}) AND {t}status = 'complete' AND {t}superseded_at IS NULL"


CLAIMABLE = claimable()
"""The futures a pool's claim can take (app.tinker.work.claim): pending work, and done work whose kept
request another pool may replay. A partial index holds only these, so the claim, which every pool polls
every poll interval, reads a handful of rows instead of every retained future (bench/tinker_claim.py).
Postgres uses a partial index only where it can prove from the query's filter that this predicate holds;
the claim's own terms are bound parameters, which a generic plan (a prepared statement after a few runs)
cannot look into, so the claim also states this predicate literally (`claimable("tinker_futures")`;
tests/app/test_tinker_claim_index.py checks the plan, generic included). SQLite keeps the index too but
its planner does not use it for this query."""


class TinkerSession(Base):
    __tablename__ = "tinker_sessions"
    __table_args__ = (
        # `create_session` counts the tenant's live sessions (unfinished, heartbeat recent) through
        # this; the tenant_id index alone read every session it ever opened.
        Index(
            "ix_tinker_sessions_live",
            "tenant_id",
            "last_heartbeat_at",
            postgresql_where=text("finished_at IS NULL"),
            sqlite_where=text("finished_at IS NULL"),
        ),
        # The sweeper purges finished sessions by age (app.tinker.service.purge_finished_sessions).
        Index(
            "ix_tinker_sessions_finished",
            "finished_at",
            postgresql_where=text("finished_at IS NOT NULL"),
            sqlite_where=text("finished_at IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    sdk_version: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)


class TinkerModel(Base):
    """A Tinker training model: `{session}:train:{model_seq_id}`, backed by one run."""

    __tablename__ = "tinker_models"
    __table_args__ = (UniqueConstraint("session_id", "model_seq_id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("tinker_sessions.id", ondelete="CASCADE"))
    model_seq_id: Mapped[int] = mapped_column(Integer)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_request_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    served_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    """When a pool's claim last took this model's work (None: never); the claim's deal order
    (`app.tinker.work.claim_query`)."""


class TinkerFuture(Base):
    """One submitted request and, once done, its result or error (what retrieve_future answers).

    (model_id, seq_id) is unique: the SDK numbers every request of a model, so a retried
    submission finds the future of the first one instead of being applied twice."""

    __tablename__ = "tinker_futures"
    __table_args__ = (
        UniqueConstraint("model_id", "seq_id"),
        Index(
            "ix_tinker_futures_claimable",
            "run_id",
            "seq_id",
            postgresql_where=text(CLAIMABLE),
            sqlite_where=text(CLAIMABLE),
        ),
        # The tenant's pending count and the bytes of its unfinished requests, read from the index
        # alone (an index-only scan on Postgres): a handful of rows, not the day's history.
        Index(
            "ix_tinker_futures_unfinished",
            "tenant_id",
            "status",
            "request_bytes",
            postgresql_where=text(unfinished()),
            sqlite_where=text(unfinished()),
        ),
        # A tenant's saves (checkpoint listings, the saved-states quota: app.tinker.checkpoints)
        # without reading the rest of its retained futures.
        Index("ix_tinker_futures_tenant_kind", "tenant_id", "kind"),
        # A tenant's newest save of each path, for the quotas on saves (app.tinker.checkpoints
        # `kept_query`): a tenant saving under one name at every step leaves a row per step, which
        # the quotas read, under the tenant's lock, on every save (207 ms at 50,000 of one name).
        Index(
            "ix_tinker_futures_current_saves",
            "tenant_id",
            "kind",
            postgresql_where=text(current_saves()),
            sqlite_where=text(current_saves()),
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    model_id: Mapped[str | None] = mapped_column(String(64), default=None)
    seq_id: Mapped[int | None] = mapped_column(Integer, default=None)
    run_id: Mapped[str | None] = mapped_column(String(16), default=None, index=True)
    """The model's run, for work the pool executes (forward_backward, optim_step)."""
    status: Mapped[str] = mapped_column(String(16), default="pending")
    """pending (waiting for the pool) | running (claimed by it) | complete | failed."""
    pool_id: Mapped[str | None] = mapped_column(String(32), default=None, index=True)
    """running: the pool whose claim it is (its lease: the claim lasts while that pool is alive).
    A complete forward_backward / load_weights whose request is kept: the pool whose memory holds
    its effect (the accumulated gradient); another pool replays it (app.tinker.leases)."""
    lost_leases: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    """How many pools died, stopped or were replaced while running it (app.tinker.leases
    `return_pool_work`): at `MAX_LOST_LEASES` it fails instead of going back to pending, so that a
    request that stops every pool that runs it cannot stop them forever (a crash loop)."""
    request: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    """The work for the pool (contracts.tinker_work.ManualWorkItem fields), while it is not done;
    for a forward_backward or load_weights, until the run's next optim_step is checkpointed (a new
    pool rebuilds the step's gradients from them after a crash)."""
    tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    """What the request costs a pool's round (app.tinker.work.work_tokens), written with it: the
    claim cuts its rounds by this number without reading the request (up to megabytes of JSON)."""
    request_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    """The size of the stored request's JSON (app.tinker.work.request_json_bytes), written with it:
    the tenant's unfinished requests are bounded by their sum
    (`Settings.tinker_max_pending_bytes_per_tenant`). A column, not the length of `request` taken in
    SQL: that reads (detoasts) every unfinished request, up to the bound's gigabyte, at every submit;
    this sum is read from an index alone (`unfinished`)."""
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    error_category: Mapped[str | None] = mapped_column(String(16), default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None, index=True)
    superseded_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=None)
    """A completed save: when a newer save of its path completed (`app.tinker.work.record_results`);
    None while it is its path's newest. The quotas on saves, the checkpoint listings and every call
    that takes a path, and the pruning's pins (app/adapters/pruning.py), read the newest saves alone
    (`current_saves`); a checkpoint's deletion marks all its path's saves."""

    def saved_path(self) -> str | None:
        """The `tinker://` path a completed save names; None for other futures and once the user
        deleted that checkpoint (`app.tinker.checkpoints`)."""
        result = self.result or {}
        if self.status != "complete" or result.get(CHECKPOINT_DELETED):
            return None
        path = result.get("path")
        return path if isinstance(path, str) else None


class TinkerBaseTurn(Base):
    """When a pool's claim last took a tenant's samples of a base model: the base-sample claim's
    deal order (`app.tinker.sampling.base_samples_query`), as `TinkerModel.served_at` is the run
    work's. `model_id` is the base model's key (`app.tinker.sampling.base_model_key`)."""

    __tablename__ = "tinker_base_turns"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    served_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class TinkerSamplingSession(Base):
    """A sampling client's session: the run adapter (at a step) it samples from."""

    __tablename__ = "tinker_sampling_sessions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    """Indexed: deleting a run (the retention purge, app/retention.py) deletes its sampling sessions,
    which without it read the whole table for every run."""
    step: Mapped[int] = mapped_column(Integer)
    model_path: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
