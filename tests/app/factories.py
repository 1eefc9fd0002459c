"""Direct-to-database test data, for tests of one component that need a tenant or a run
without going through the runs API."""

from sqlalchemy.orm import Session

from app.auth import hash_key, new_api_key
from app.runs.models import Run
from app.tenants.models import ApiKey, Tenant
from contracts.ids import new_id
from contracts.run_config import RunConfig


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
