"""Changing a tenant's quota of concurrent runs (`max_concurrent_runs`). Keyword-only, never commits.

The quota bounds admissions, never what was admitted: lowered below the tenant's active runs, those
keep their slots, and its queued runs wait until fewer than the new quota are active (admission
counts a tenant's active runs against its quota each time, app/runs/service.py). Raised, the
tenant's queued runs that now fit are admitted at once, into the free slots of their base models,
in the queue's order, as when a slot frees (`admit_queued_runs`); otherwise they would wait for the
next run to leave a slot of their base model."""

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.config import Settings
from app.events.service import record_event
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.runs.service import admit_queued_runs
from app.tenants.models import Tenant
from app.tenants.service import get_tenant, lock_tenant
from contracts.status import RunStatus


def update_quota(session: Session, *, tenant_id: str, max_concurrent_runs: int, settings: Settings) -> Tenant:
    """Set the tenant's quota (a 404 if it is gone); admits the queued runs a raise lets in."""
    # In lock order (admission, then the tenant's row): no admission reads the old quota while it
    # changes, and the admissions below see the new one.
    lock_admission(session)
    lock_tenant(session, tenant_id=tenant_id)
    tenant = get_tenant(session, tenant_id=tenant_id)
    previous = tenant.max_concurrent_runs
    if max_concurrent_runs == previous:
        return tenant  # nothing changed: no event, nothing to admit
    tenant.max_concurrent_runs = max_concurrent_runs
    session.flush()
    record_event(
        session,
        action="tenant.updated",
        actor="admin",
        tenant_id=tenant_id,
        details={"max_concurrent_runs": max_concurrent_runs, "previous_max_concurrent_runs": previous},
    )
    if max_concurrent_runs > previous:
        waiting = session.scalars(
            select(Run.base_model)
            .where(Run.tenant_id == tenant_id, Run.status == RunStatus.QUEUED)
            .distinct()
            .order_by(Run.base_model)
        )
        for base_model in list(waiting):
            admit_queued_runs(session, base_model=base_model, settings=settings)
    return tenant
