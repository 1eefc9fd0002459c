"""Test data written straight into the database, and reads of it that bypass the API.

For tests of one component that need a tenant, a run, a pool or a leased batch without going
through the API that makes them (tests/app/api.py holds the calls through the API).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.auth import hash_key, new_api_key
from app.batches.models import Batch
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.pools.models import Pool
from app.runs.models import Run
from app.tenants.models import ApiKey, Tenant
from contracts.ids import new_id
from contracts.run_config import RunConfig

# --------------------------------------------------------------------------- sessions


@contextmanager
def committed(settings: Settings) -> Iterator[Session]:
    """A session on the test database of its own, committed on exit."""
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            yield session
            session.commit()
    finally:
        engine.dispose()


def end_read(db: Session) -> None:
    """End the test session's transaction before the app writes: on SQLite an open one holds the
    database's write lock (the app's sessions begin IMMEDIATE). The factory does not expire on
    commit, so the rows read stay readable."""
    db.commit()


# --------------------------------------------------------------------------- rows


def make_tenant(session: Session, *, name: str | None = None, quota: int = 4) -> tuple[Tenant, str]:
    """A tenant and one API key for it; returns (tenant, secret)."""
    tenant = Tenant(id=new_id("ten"), name=name or new_id("tenant"), max_concurrent_runs=quota)
    secret = new_api_key()
    session.add(tenant)
    session.flush()
    session.add(ApiKey(id=new_id("key"), tenant_id=tenant.id, key_hash=hash_key(secret), prefix=secret[:8]))
    session.flush()
    return tenant, secret


def make_run(
    session: Session,
    tenant: Tenant,
    *,
    status: str = "active",
    slot: int | None = 0,
    config: RunConfig | None = None,
) -> Run:
    config = config or RunConfig()
    run = Run(
        id=new_id("run"),
        tenant_id=tenant.id,
        name="test-run",
        config=config.model_dump(mode="json"),
        base_model=config.base_model,
        status=status,
        slot=slot if status == "active" else None,
    )
    session.add(run)
    session.flush()
    return run


@dataclass(frozen=True)
class Seeded:
    tenant_id: str
    secret: str
    run_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"}


def seed_run(
    settings: Settings,
    *,
    status: str = "active",
    config: RunConfig | None = None,
    tenant_id: str | None = None,
    **fields: Any,
) -> Seeded:
    """A tenant (new unless tenant_id is given; then the secret is empty) and one run in `status`
    (active runs get the next free slot of their base model)."""
    with committed(settings) as session:
        base_model = (config or RunConfig()).base_model
        used = session.scalar(
            select(func.max(Run.slot)).where(Run.status == "active", Run.base_model == base_model)
        )
        slot = 0 if used is None else used + 1
        secret = ""
        if tenant_id is None:
            tenant, secret = make_tenant(session)
        else:
            found = session.get(Tenant, tenant_id)
            assert found is not None, tenant_id
            tenant = found
        run = make_run(session, tenant, status=status, slot=slot, config=config)
        for name, value in fields.items():
            setattr(run, name, value)
        return Seeded(tenant_id=tenant.id, secret=secret, run_id=run.id)


def add_pool(
    settings: Settings, *, base_model: str = "loraloom-tiny", vocab_size: int = 1000, status: str = "alive"
) -> str:
    """A registered pool row (no admission work, unlike registering through the API); returns its id."""
    with committed(settings) as session:
        pool = Pool(
            id=new_id("pool"),
            base_model=base_model,
            vocab_size=vocab_size,
            max_rank=64,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            slots=4,
            world_size=1,
            max_seq_len=4096,
            status=status,
        )
        session.add(pool)
        return pool.id


def claimed_batch(db: Session, *, run_id: str, pool_id: str, lease_expires_at: datetime) -> int:
    """A batch leased to a pool, written directly (the claim path has its own tests)."""
    batch = Batch(
        run_id=run_id,
        request_hash="0" * 64,
        rollout_step=0,
        num_samples=1,
        num_tokens=8,
        sample_offset=0,
        payload_path=f"runs/{run_id}/rollouts/x.msgpack",
        payload_bytes=1,
        payload_sha256="0" * 64,
        state="claimed",
        pool_id=pool_id,
        lease_expires_at=lease_expires_at,
        claimed_at=datetime.now(UTC),
    )
    db.add(batch)
    db.commit()
    return batch.id


# --------------------------------------------------------------------------- reads


def run_row(db: Session, run_id: str) -> Run:
    """The run as committed now (the test session's transaction is ended after the read)."""
    db.expire_all()
    run = db.get(Run, run_id)
    assert run is not None
    end_read(db)
    return run


def row_counts(settings: Settings, *models: Any) -> tuple[int, ...]:
    """Rows per table, read on a connection of its own (so it sees only committed data)."""
    engine = make_engine(settings.database_url)
    try:
        with Session(engine) as session:
            return tuple(session.scalar(select(func.count()).select_from(m)) or 0 for m in models)
    finally:
        engine.dispose()


def batch_count(settings: Settings) -> int:
    with committed(settings) as session:
        return session.scalar(select(func.count()).select_from(Batch)) or 0


def batch_states(settings: Settings) -> dict[int, tuple[str, str | None, int | None]]:
    """Every batch's (state, pool_id, trained_step), by id."""
    with committed(settings) as session:
        return {
            b.id: (b.state, b.pool_id, b.trained_step)
            for b in session.scalars(select(Batch).order_by(Batch.id))
        }


def rollout_files(settings: Settings) -> list[Path]:
    """Everything under any run's rollouts/ (temporaries included)."""
    return sorted(p for p in settings.runs_dir.glob("*/rollouts/**/*") if p.is_file())
