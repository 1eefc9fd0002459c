"""Tinker sessions, training models and futures on top of runs. Keyword-only, raises domain
errors, never commits.

A Tinker training model is a loraloom run in manual mode (`config.mode = "manual"`), created
and admitted like every other run, so it shows in GET /v1/runs, takes a slot within the
tenant's quota and is evicted or deleted by the same rules.
"""

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import Select, and_, delete, exists, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import InstrumentedAttribute, Session, defer

from app.config import Settings
from app.db import rows_changed, utcnow
from app.errors import AppError, Conflict, NotFound, RateLimited, ValidationFailed, problem
from app.pools.models import Pool
from app.runs import service as runs
from app.runs.admission import admission_problems, live_pool, waiting_reason
from app.runs.models import Run
from app.runs.schemas import RunCreate
from app.tenants.models import Tenant
from app.tinker.models import SAVE_KINDS, TinkerFuture, TinkerModel, TinkerSamplingSession, TinkerSession
from app.tinker.schemas import (
    TINKER_LORA_ALPHA,
    CreateModelRequest,
    CreateSessionRequest,
    GetInfoResponse,
    ModelData,
    SupportedModel,
    TrainingRunOut,
    shown,
)
from contracts.ids import new_id
from contracts.run_config import LoraSettings, RunConfig
from contracts.status import MOVABLE_RUN_STATUSES, PoolStatus, RunStatus

log = logging.getLogger(__name__)

MANUAL_MAX_STEPS = 1_000_000
"""The largest max_steps a RunConfig allows: a manual run is stepped by its user, never completed."""


class NotSupported(AppError):
    """A Tinker call or option loraloom does not serve (the SDK surfaces the message)."""

    status = 400
    code = "not_supported"

    def __init__(self, what: str) -> None:
        super().__init__(f"not supported by loraloom: {what}")


class ModelIdTaken(AppError):
    """422: the run of a new model `{session}:train:{n}` is created with the Idempotency-Key
    `tinker:{model_id}`, and the tenant used that key already for a run of another body (through
    /v1/runs). Not the runs API's 409 `idempotency_conflict`: the official SDK retries a 409 of
    create_model ten times (about a minute) and one of load_weights for 5 minutes, whatever
    `x-should-retry` says, and no retry can free the key. On a 422 it raises at once, a
    `tinker.UnprocessableEntityError` carrying this message."""

    status = 422
    code = "model_id_taken"


class SessionFinished(AppError):
    """410: the SDK stops its heartbeat loop on this status."""

    status = 410
    code = "session_finished"


# --- sessions -----------------------------------------------------------------------------


SESSION_SILENT_SECONDS = 300.0
"""A session with no heartbeat for this long (the SDK sends one every 10 s) is no longer live: its
process is gone. It is not finished either (a heartbeat revives it), and its models stay."""
SESSION_RETRY_AFTER_SECONDS = 10


def live_sessions_query(tenant_id: str, *, now: datetime) -> Select[int]:
    """How many of the tenant's sessions are live: unfinished, with a heartbeat in the last
    SESSION_SILENT_SECONDS (read through the partial index `ix_tinker_sessions_live`)."""
    return (
        select(func.count())
        .select_from(TinkerSession)
        .where(
            TinkerSession.tenant_id == tenant_id,
            TinkerSession.finished_at.is_(None),
            TinkerSession.last_heartbeat_at >= now - timedelta(seconds=SESSION_SILENT_SECONDS),
        )
    )


def create_session(
    session: Session, *, tenant_id: str, body: CreateSessionRequest, settings: Settings
) -> TinkerSession:
    """A new session, within the tenant's live sessions (`Settings.tinker_max_live_sessions_per_tenant`;
    counted from this transaction's snapshot: concurrent creations may pass it by the tenant's
    requests in flight, a flood guard). The bound is on creating session rows: a heartbeat bringing
    a silent session back adds none, and being live gates nothing a session does, so it is not
    checked there (refusing it would only leave an honest client's SDK warning forever)."""
    most = settings.tinker_max_live_sessions_per_tenant
    live = session.scalar(live_sessions_query(tenant_id, now=utcnow()))
    if live is not None and live >= most:
        raise RateLimited(
            f"this tenant has {live} live Tinker sessions, the most it may hold; close some "
            f"(ServiceClient.close / POST /api/v1/sessions/{{id}}/finish) or let them go silent "
            f"({SESSION_SILENT_SECONDS:.0f} s without a heartbeat)",
            details={"kind": "live_sessions", "live": live, "limit": most},
            retry_after=SESSION_RETRY_AFTER_SECONDS,
        )
    row = TinkerSession(id=new_id("ses"), tenant_id=tenant_id, sdk_version=body.sdk_version)
    session.add(row)
    session.flush()
    return row


def get_session(session: Session, *, tenant_id: str, session_id: str) -> TinkerSession:
    """The tenant's session; another tenant's is reported exactly like a missing one."""
    row = session.get(TinkerSession, session_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"session {shown(session_id)} not found")
    return row


def heartbeat(session: Session, *, tenant_id: str, session_id: str) -> None:
    row = get_session(session, tenant_id=tenant_id, session_id=session_id)
    if row.finished_at is not None:
        raise SessionFinished(f"session {session_id} has finished")
    row.last_heartbeat_at = utcnow()


def finish_session(session: Session, *, tenant_id: str, session_id: str) -> None:
    """Mark the session finished (first call wins). Its models stay: they are runs the tenant
    manages through /v1/runs."""
    row = get_session(session, tenant_id=tenant_id, session_id=session_id)
    if row.finished_at is None:
        row.finished_at = utcnow()


PURGE_CHUNK = 500
"""Rows one chunk of `purge_finished_sessions` deletes at most (one transaction)."""


@dataclass
class SessionsPurged:
    """What one chunk of `purge_finished_sessions` deleted."""

    sessions: int = 0
    """Tinker sessions (finished, or silent, and owning no model)."""
    sampling_sessions: int = 0
    """Sampling sessions of runs that left."""
    more: bool = False
    """The chunk used its whole budget: more may be due (run another chunk)."""


def _delete_chosen(session: Session, pk: InstrumentedAttribute[str], chosen: Select[str]) -> int:
    """Delete the rows `chosen` selects (their ids, at most a chunk), skipping rows another
    transaction holds (Postgres: SKIP LOCKED; SQLite has no row locks); only `pk`'s table is
    locked, never a run row it joins. Returns how many."""
    return rows_changed(
        session,
        delete(pk.class_)
        .where(pk.in_(chosen.with_for_update(of=pk.class_, skip_locked=True)))
        .execution_options(synchronize_session=False),
    )


def purge_finished_sessions(
    session: Session, *, now: datetime, retention_seconds: float, chunk: int = PURGE_CHUNK
) -> SessionsPurged:
    """One chunk of the purge of what Tinker sessions leave behind, `retention_seconds` after (0:
    nothing is purged): at most `chunk` rows, in the caller's transaction. Never commits.

    - Tinker sessions finished before the retention, and unfinished ones without a heartbeat for
      as long (and at least SESSION_SILENT_SECONDS: the SDK's process is gone), that own no model.
      A session with models stays while they do (their ids name it; the retention of deleted runs
      deletes the models, app/retention.py, and the session goes at a later chunk). Each create
      and finish added a row for ever: 85 a second from one tenant (hostile probe, finding 11).
    - Sampling sessions created before the retention whose run has left (evicted, completed,
      failed, deleted): none of them samples again. A deleted run's go with its purge anyway.

    A session purged is a 404 to a late heartbeat or finish, like one never made."""
    if retention_seconds <= 0 or chunk <= 0:
        return SessionsPurged()
    cutoff = now - timedelta(seconds=retention_seconds)
    silent_before = min(cutoff, now - timedelta(seconds=SESSION_SILENT_SECONDS))
    no_model = ~exists().where(TinkerModel.session_id == TinkerSession.id)
    out = SessionsPurged()
    budget = chunk
    # Two statements, each on its own index: finished (ix_tinker_sessions_finished), then silent
    # (ix_tinker_sessions_live holds the unfinished ones).
    for due in (
        and_(TinkerSession.finished_at.is_not(None), TinkerSession.finished_at < cutoff),
        and_(TinkerSession.finished_at.is_(None), TinkerSession.last_heartbeat_at < silent_before),
    ):
        if budget > 0:
            chosen = select(TinkerSession.id).where(due, no_model).limit(budget)
            out.sessions += _delete_chosen(session, TinkerSession.id, chosen)
            budget = chunk - out.sessions
    if budget > 0:
        left = (
            select(TinkerSamplingSession.id)
            .join(Run, Run.id == TinkerSamplingSession.run_id)
            .where(TinkerSamplingSession.created_at < cutoff, Run.status.not_in(MOVABLE_RUN_STATUSES))
            .limit(budget)
        )
        out.sampling_sessions = _delete_chosen(session, TinkerSamplingSession.id, left)
    out.more = out.sessions + out.sampling_sessions >= chunk
    if out.sessions or out.sampling_sessions:
        log.info(
            "tinker: purged %s session(s) and %s sampling session(s) done before %s",
            out.sessions,
            out.sampling_sessions,
            cutoff.isoformat(),
        )
    return out


# --- capabilities and models ----------------------------------------------------------------


def capabilities(session: Session) -> list[SupportedModel]:
    """One entry per base model a live pool serves."""
    pools = session.scalars(select(Pool).where(Pool.status == PoolStatus.ALIVE).order_by(Pool.base_model))
    seen: dict[str, SupportedModel] = {}
    for pool in pools:
        seen.setdefault(
            pool.base_model, SupportedModel(model_name=pool.base_model, max_context_length=pool.max_seq_len)
        )
    return list(seen.values())


def _run_config(session: Session, body: CreateModelRequest) -> RunConfig:
    lora = body.lora_config
    if lora is None:
        raise NotSupported(
            "full fine-tuning (create_model without lora_config); loraloom trains LoRA adapters"
        )
    if not lora.target_modules():
        no_modules = "at least one of train_attn, train_mlp or train_unembed must be true"
        # `loc` as FastAPI's own 422s of this route (a typed body) write it: under "body".
        raise ValidationFailed(no_modules, details=[problem(("body", "lora_config"), no_modules)])
    if body.optimizer_config.type != "adamw":
        raise NotSupported(f"optimizer {body.optimizer_config.type!r}; loraloom steps AdamW")
    pool = live_pool(session, base_model=body.base_model)
    seq_len = RunConfig.model_fields["seq_len"].default if pool is None else pool.max_seq_len
    return RunConfig(
        base_model=body.base_model,
        mode="manual",
        lora=LoraSettings(rank=lora.rank, alpha=TINKER_LORA_ALPHA, target_modules=lora.target_modules()),
        seq_len=seq_len,
        # The user steps the run; it never completes by itself.
        max_steps=MANUAL_MAX_STEPS,
        seed=lora.seed or 0,
    )


def create_model(
    session: Session, *, tenant_id: str, api_key_id: str, body: CreateModelRequest, settings: Settings
) -> TinkerFuture:
    """Create the model's run (or find it again: a retried create with the same session and
    model_seq_id is the same model) and return the completed creation future."""
    owner = get_session(session, tenant_id=tenant_id, session_id=body.session_id)
    model_id = f"{owner.id}:train:{body.model_seq_id}"
    existing = _create_future(session, model_id)
    if existing is not None:
        return existing
    if session.get(TinkerModel, model_id) is not None:
        # A twin create committed since the query above (READ COMMITTED), or load_weights made it.
        if (twin := _create_future(session, model_id)) is not None:
            return twin
        made = f"model {model_id} exists already (loaded from saved weights)"
        raise ValidationFailed(made, details=[problem(("body", "model_seq_id"), made, "already_exists")])
    try:
        with session.begin_nested():  # a savepoint: a concurrent twin's create wins, not a 500
            new_model_run(
                session,
                tenant_id=tenant_id,
                api_key_id=api_key_id,
                owner=owner,
                model_seq_id=body.model_seq_id,
                config=_run_config(session, body),
                user_metadata=body.user_metadata,
                settings=settings,
            )
            return complete_future(
                session,
                tenant_id=tenant_id,
                kind="create_model",
                model_id=model_id,
                result={"model_id": model_id, "type": "create_model"},
            )
    except IntegrityError:
        # The same create sent twice at once: the second waited on the model's key until the
        # first committed; answer with the first's future.
        if (twin := _create_future(session, model_id)) is None:
            raise
        return twin


def _create_future(session: Session, model_id: str) -> TinkerFuture | None:
    return session.scalar(
        select(TinkerFuture).where(TinkerFuture.model_id == model_id, TinkerFuture.kind == "create_model")
    )


def new_model_run(
    session: Session,
    *,
    tenant_id: str,
    api_key_id: str,
    owner: TinkerSession,
    model_seq_id: int,
    config: RunConfig,
    user_metadata: dict[str, Any] | None,
    settings: Settings,
) -> tuple[TinkerModel, Run]:
    """The run of a new model `{session}:train:{model_seq_id}` (422 if the live pool cannot train
    it, or if its run's idempotency key is taken: `ModelIdTaken`)."""
    model_id = f"{owner.id}:train:{model_seq_id}"
    problems = admission_problems(session, config=config.model_dump(mode="json"))
    if problems:
        raise ValidationFailed(
            f"the pool serving {config.base_model} cannot train this model: {'; '.join(problems)}",
            details=[{"loc": ["body", "lora_config"], "msg": p, "type": "pool_capability"} for p in problems],
        )
    key = f"tinker:{model_id}"
    try:
        run, _ = runs.create_run(
            session,
            tenant_id=tenant_id,
            api_key_id=api_key_id,
            body=RunCreate(name=f"tinker {model_id}", config=config),
            idempotency_key=key,
            settings=settings,
        )
    except Conflict as exc:
        if exc.code != "idempotency_conflict":
            raise
        raise ModelIdTaken(
            f"model {model_id} cannot be created: its run's Idempotency-Key {key!r} was already used "
            f"for run {exc.details['run_id']} with another body (a run created through /v1/runs); "
            "create the model in a new session (a new ServiceClient)",
            details={"model_id": model_id, "idempotency_key": key, "run_id": exc.details["run_id"]},
        ) from exc
    model = TinkerModel(
        id=model_id,
        tenant_id=tenant_id,
        session_id=owner.id,
        model_seq_id=model_seq_id,
        run_id=run.id,
        user_metadata=user_metadata,
    )
    session.add(model)
    session.flush()
    return model, run


def get_model(session: Session, *, tenant_id: str, model_id: str) -> tuple[TinkerModel, Run]:
    """The tenant's model and its run; another tenant's is reported exactly like a missing one."""
    model = session.get(TinkerModel, model_id)
    if model is None or model.tenant_id != tenant_id:
        raise NotFound(f"model {shown(model_id)} not found")
    return model, runs.get_run(session, run_id=model.run_id)


def get_listed_model(session: Session, *, tenant_id: str, model_id: str) -> tuple[TinkerModel, Run]:
    """`get_model` for the reads of a model (its training run, its checkpoints, get_info): a model
    whose run is deleted is reported exactly like a missing one, as the listings leave it out and
    its saved paths are gone (`checkpoints.live_saves`). The reads answered 200 for it until the
    retention purge removed its row. Submissions keep `get_model`: they say the run is deleted
    (400 `run_not_active`), which tells a client still driving it why it stopped."""
    model, run = get_model(session, tenant_id=tenant_id, model_id=model_id)
    if run.status == RunStatus.DELETED:
        raise NotFound(f"model {shown(model_id)} not found")
    return model, run


def model_info(session: Session, *, tenant_id: str, model_id: str) -> GetInfoResponse:
    """get_info. Its `tokenizer_id` is the base model's name as the user gave it (a hub id, or the
    built-in model's name), which the SDK's `get_tokenizer()` loads with
    `AutoTokenizer.from_pretrained` on the user's machine, as on Tinker. It was a path on the
    service's machine for the built-in model: that told every tenant the server's layout (an
    absolute path into the data directory), and a client on another machine could not load it
    anyway. The built-in model is on no hub: a client loads its character tokenizer from a directory
    of that name in its working directory (`contracts.tokenizer_files.save_char_tokenizer`)."""
    model, run = get_listed_model(session, tenant_id=tenant_id, model_id=model_id)
    rank = int(run.config["lora"]["rank"])
    return GetInfoResponse(
        model_data=ModelData(model_name=run.base_model, tokenizer_id=run.base_model),
        model_id=model.id,
        lora_rank=rank,
        model_name=run.base_model,
    )


def training_run_out(model: TinkerModel, run: Run) -> TrainingRunOut:
    return TrainingRunOut(
        training_run_id=model.id,
        base_model=run.base_model,
        model_owner=model.tenant_id,
        lora_rank=int(run.config["lora"]["rank"]),
        corrupted=run.status == RunStatus.FAILED,
        last_request_time=model.last_request_at.isoformat(),
        # A dict by validation; a row stored before user_metadata was checked may hold anything.
        user_metadata={str(k): str(v) for k, v in metadata.items()} or None
        if isinstance(metadata := model.user_metadata, dict)
        else None,
    )


def list_training_runs(
    session: Session, *, tenant_id: str, limit: int, offset: int
) -> tuple[list[TrainingRunOut], int]:
    """The tenant's Tinker models whose runs are not deleted, newest first."""
    base = (
        select(TinkerModel, Run)
        .join(Run, Run.id == TinkerModel.run_id)
        .where(TinkerModel.tenant_id == tenant_id, Run.status != RunStatus.DELETED)
    )
    total = session.scalar(select(func.count()).select_from(base.subquery())) or 0
    rows = session.execute(
        base.order_by(TinkerModel.created_at.desc(), TinkerModel.id.desc()).limit(limit).offset(offset)
    ).all()
    return [training_run_out(model, run) for model, run in rows], int(total)


# --- futures ------------------------------------------------------------------------------


def complete_future(
    session: Session, *, tenant_id: str, kind: str, model_id: str | None, result: dict[str, object]
) -> TinkerFuture:
    future = TinkerFuture(
        id=new_id("req"),
        tenant_id=tenant_id,
        kind=kind,
        model_id=model_id,
        status="complete",
        result=result,
        completed_at=utcnow(),
    )
    session.add(future)
    session.flush()
    return future


def get_future(session: Session, *, tenant_id: str, request_id: str) -> TinkerFuture:
    """The tenant's future, without its request (loaded only if read: retrieve_future checks a
    pending future many times a second, and a forward_backward's request is up to ~20 MB of JSON)."""
    future = session.get(TinkerFuture, request_id, options=[defer(TinkerFuture.request)])
    if future is None or future.tenant_id != tenant_id:
        # Done futures are deleted after the retention: say so, the likeliest reason for a known id.
        raise NotFound(
            f"request {shown(request_id)} not found (done requests are kept "
            f"LORALOOM_TINKER_FUTURE_TTL_SECONDS after they finish, then purged)"
        )
    return future


RESULT_NAMES_MODEL = ("create_model", "load_weights", *SAVE_KINDS)
"""Futures whose result names their model (create_model, load_weights) or one of its checkpoint
paths (the saves: `tinker://<model>/...`)."""


QueueStateName = Literal["active", "paused_capacity", "paused_rate_limit"]

QUOTA_RUNS_NAMED = 3
"""How many of the runs holding a tenant's quota a "try again" names."""


def queue_state(
    session: Session, *, future: TinkerFuture, settings: Settings
) -> tuple[QueueStateName, str | None]:
    """What a "try again" of a pending future says: `queue_state` and `queue_state_reason`, the
    fields the SDK reads from it (tinker 0.38 `_TryAgain`) and hands to its `QueueStateLogger`,
    which logs `Training for <model> is paused. Reason: <reason>.` once a pause has lasted its
    grace period, then every minute. Without them a model whose run waits for a place (the
    tenant's quota in use, or no free slot) only printed `Retrying request ... because of
    try_again` for ever; the reason was in GET /v1/runs/{id} alone (probe report, finding 5).

    `paused_rate_limit` when the tenant's quota of concurrent runs holds it back (Tinker's own state
    for its limit on concurrent training clients), `paused_capacity` when the base model's slots
    or pool do; `active` (no reason) for work whose run holds a slot, which waits for the pool."""
    run = None if future.run_id is None else session.get(Run, future.run_id)
    if run is None or run.status != RunStatus.QUEUED:
        return "active", None
    queued = f"the model's run {run.id} is queued"
    quota = session.scalar(select(Tenant.max_concurrent_runs).where(Tenant.id == run.tenant_id))
    holding = and_(Run.tenant_id == run.tenant_id, Run.status == RunStatus.ACTIVE)
    active = session.scalar(select(func.count()).select_from(Run).where(holding)) or 0
    if quota is not None and active >= quota:
        named = session.scalars(
            select(Run.id).where(holding).order_by(Run.started_at, Run.id).limit(QUOTA_RUNS_NAMED)
        ).all()
        more = ", ..." if active > len(named) else ""
        return "paused_rate_limit", (
            f"{queued}: the tenant's quota of {quota} concurrent runs is in use (by {', '.join(named)}{more}); "
            "it starts when one of them leaves: DELETE /v1/runs/{id} frees a place, and a Tinker "
            "model whose process is gone (and that saved no sampler weights) leaves by itself "
            f"{settings.tinker_session_timeout_seconds:g} s after its session's last heartbeat"
        )
    return "paused_capacity", f"{queued}: {waiting_reason(session, run=run, settings=settings)}"


def check_named_model(session: Session, *, future: TinkerFuture) -> None:
    """404 `model ... not found` for a completed future whose result names a model whose run is
    deleted (`RESULT_NAMES_MODEL`), the answer every read of such a model gets (`get_listed_model`).
    retrieve_future answered such a save 200 with its `tinker://` path until the retention purge
    took the future, and the SDK handed that path to the user as a fine result while it no longer
    loads, resolves or samples (`checkpoints.live_saves`). On the 404 the SDK's `result()` raises
    at once (a ValueError carrying the message; it retries no 404).

    Only these: a failed future keeps its answer (the reason it failed, such as its run leaving),
    and the other completed work (forward, forward_backward, optim_step, samples) its result,
    computed numbers that stay true and name nothing gone; all of it goes with the run's purge."""
    if future.status == "complete" and future.kind in RESULT_NAMES_MODEL and future.model_id is not None:
        get_listed_model(session, tenant_id=future.tenant_id, model_id=future.model_id)


def touch_model(session: Session, *, model_id: str, now: datetime | None = None) -> None:
    model = session.get(TinkerModel, model_id)
    if model is not None:
        model.last_request_at = now or utcnow()
