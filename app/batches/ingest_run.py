"""What batch ingestion needs to know about a run, read in one statement without ORM objects.

The run's state, its config and the vocabulary size of its base model's pool come back in a single
row (the vocabulary as a scalar subquery), so the hot path spends one round trip before the
payload is written. The ORM `Run` of the documented route converts with `IngestRun.of`.
"""

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ScalarSelect, Select, bindparam, select
from sqlalchemy.orm import Session

from app.db import pg_execute
from app.errors import NotFound
from app.pools.models import Pool
from app.runs.models import Run
from contracts.ids import is_run_id
from contracts.status import PoolStatus


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
