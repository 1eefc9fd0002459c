"""What batch ingestion needs to know about a run, read in one statement without ORM objects.

The run's state, its config and the vocabulary size of its base model's pool come back in a single
row (the vocabulary as a scalar subquery), so the hot path spends one round trip before the
payload is written, and none for an active run read in the last `ingest_run_cache_seconds`
(`cached_ingest_run`): what the read gives the route before the payload is written (the config,
the vocabulary, an early refusal) need not be current, because the insert statement reads the
run's state again under its row lock (app/batches/one_statement.py) and refuses a run that left.
The ORM `Run` of the documented route converts with `IngestRun.of`.
"""

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ScalarSelect, Select, bindparam, select
from sqlalchemy.orm import Session
from starlette.datastructures import State

from app.db import pg_execute
from app.errors import NotFound
from app.pools.models import Pool
from app.runs.models import Run
from app.ttl_cache import TtlCache, state_cache
from contracts.ids import is_run_id
from contracts.status import PoolStatus, RunStatus


@dataclass(frozen=True)
class IngestRun:
    """A run as ingestion sees it (read once before the payload is written, again under the run
    row lock in the insert statement)."""

    id: str
    tenant_id: str
    status: str
    step: int
    eviction_reason: str | None
    evicted_by: str | None
    config: dict[str, Any]
    vocab_size: int | None
    """Of the pool serving the run's base model (the live one first); None if no pool ever
    registered for it (token ids are then only checked to fit int32)."""

    @classmethod
    def of(cls, run: Run, *, vocab_size: int | None) -> "IngestRun":
        return cls(
            run.id,
            run.tenant_id,
            run.status,
            run.step,
            run.eviction_reason,
            run.evicted_by,
            run.config,
            vocab_size,
        )


def vocab_size_query(base_model: Any) -> ScalarSelect[int | None]:
    """The vocabulary size of `base_model` (a value or a column) as its pool reported it."""
    return (
        select(Pool.vocab_size)
        .where(Pool.base_model == base_model)
        .order_by((Pool.status == PoolStatus.ALIVE).desc(), Pool.registered_at.desc())
        .limit(1)
        .scalar_subquery()
    )


_COLUMNS = (Run.id, Run.tenant_id, Run.status, Run.step, Run.eviction_reason, Run.evicted_by, Run.config)
# Built once: SQLAlchemy caches the compiled form by the statement's key.
_LOAD: Select[Any] = select(*_COLUMNS, vocab_size_query(Run.base_model)).where(
    Run.id == bindparam("run_id"), Run.tenant_id == bindparam("tenant_id")
)


# One statement, read before the payload is written and committed at once: on Postgres it runs
# outside a transaction (no BEGIN and COMMIT round trips). SQLite keeps its own BEGIN (app/db.py).
_AUTOCOMMIT = {"isolation_level": "AUTOCOMMIT"}


def load_ingest_run(session: Session, *, tenant_id: str, run_id: str) -> IngestRun:
    """The tenant's run with its pool's vocabulary; another tenant's run is the same 404 as a
    missing one (app/runs/service.get_run_for_tenant). Call first in the session's transaction
    (on Postgres its connection is then in autocommit until the session commits)."""
    if not is_run_id(run_id):
        raise NotFound(f"run {run_id} not found")
    params = {"run_id": run_id, "tenant_id": tenant_id}
    row: Any
    if session.get_bind().dialect.name == "postgresql":
        # On the psycopg connection directly, prepared (app/db.py pg_execute).
        row = pg_execute(session.connection(execution_options=_AUTOCOMMIT), _LOAD, params)
    else:
        row = session.connection().execute(_LOAD, params).one_or_none()
    if row is None:
        raise NotFound(f"run {run_id} not found")
    return IngestRun(*row)


IngestRunCache = TtlCache[tuple[str, str], IngestRun]
"""(tenant id, run id) → the run as read, active runs only."""


def ingest_run_cache(state: State, ttl_s: float) -> IngestRunCache:
    """The app's cache of runs read by the batch route."""
    cache: IngestRunCache = state_cache(state, "ingest_run_cache", ttl_s)
    return cache


def cached_ingest_run(session: Session, cache: IngestRunCache, *, tenant_id: str, run_id: str) -> IngestRun:
    """`load_ingest_run`, or the same run as read within the cache's bound. Only active runs are
    kept (a refusal is read fresh every time); the caller drops an entry whose run turned out to
    have left (`cache.pop`)."""
    key = (tenant_id, run_id)
    run = cache.get(key)
    if run is None:
        run = load_ingest_run(session, tenant_id=tenant_id, run_id=run_id)
        if run.status == RunStatus.ACTIVE:
            cache.put(key, run)
    return run
