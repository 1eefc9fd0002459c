"""Changing a tenant: its quota of concurrent runs (`max_concurrent_runs`) and its name. Keyword-only,
never commits.

The quota bounds admissions, never what was admitted: lowered below the tenant's active runs, those
keep their slots, and its queued runs wait until fewer than the new quota are active (admission
counts a tenant's active runs against its quota each time, app/runs/service.py). Raised, the
tenant's queued runs that now fit are admitted at once, into the free slots of their base models,
in the queue's order, as when a slot frees (`admit_queued_runs`); otherwise they would wait for the
next run to leave a slot of their base model.

A name is unique whatever its case, as at creation (`uq_tenants_lower_name`, migration 0023): a name
another tenant has is a 409 naming that tenant; another case of the tenant's own name (`acme` to
`Acme`) is a rename like any other. Nothing but the name changes: ids, keys and runs stay."""

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.config import Settings
from app.errors import Conflict
from app.events.service import record_event
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.runs.service import admit_queued_runs
from app.tenants.models import Tenant
from app.tenants.service import get_tenant, lock_tenant, tenant_named
from contracts.status import RunStatus


def update_tenant(
    session: Session, *, tenant_id: str, max_concurrent_runs: int | None, name: str | None, settings: Settings
) -> Tenant:
    """Set what is given of the tenant's quota and name (a 404 if it is gone; None: unchanged); admits
    the queued runs a raised quota lets in. One `tenant.updated` event names what changed (with its
    previous value), none when nothing did."""
    if max_concurrent_runs is not None:
        # In lock order (admission, then the tenant's row): no admission reads the old quota while it
        # changes, and the admissions below see the new one. A rename alone admits nothing.
        lock_admission(session)
    lock_tenant(session, tenant_id=tenant_id)
    tenant = get_tenant(session, tenant_id=tenant_id)
    changed: dict[str, Any] = {}
    if name is not None and name != tenant.name:
        changed |= {"name": name, "previous_name": tenant.name}
        _rename(session, tenant=tenant, name=name)
    previous = tenant.max_concurrent_runs
    if max_concurrent_runs is not None and max_concurrent_runs != previous:
        changed |= {"max_concurrent_runs": max_concurrent_runs, "previous_max_concurrent_runs": previous}
        tenant.max_concurrent_runs = max_concurrent_runs
        session.flush()
    if not changed:
        return tenant  # nothing changed: no event, nothing to admit
    record_event(session, action="tenant.updated", actor="admin", tenant_id=tenant_id, details=changed)
    if max_concurrent_runs is not None and max_concurrent_runs > previous:
        waiting = session.scalars(
            select(Run.base_model)
            .where(Run.tenant_id == tenant_id, Run.status == RunStatus.QUEUED)
            .distinct()
            .order_by(Run.base_model)
        )
        for base_model in list(waiting):
            admit_queued_runs(session, base_model=base_model, settings=settings)
    return tenant


def _rename(session: Session, *, tenant: Tenant, name: str) -> None:
    """`tenant.name = name`, or the 409 of a name another tenant has whatever the case."""
    holder = tenant_named(session, name=name, other_than=tenant.id)
    if holder is not None:
        raise _name_taken(name, holder)
    try:
        # A savepoint, so that losing a race on the unique name (a tenant created or renamed since
        # the check) is a 409 naming that tenant, not a broken transaction.
        with session.begin_nested():
            tenant.name = name
    except IntegrityError as exc:
        raise _name_taken(name, tenant_named(session, name=name, other_than=tenant.id)) from exc


def _name_taken(name: str, holder: Tenant | None) -> Conflict:
    if holder is None:  # the race's winner is not visible to this transaction (SQLite never races)
        return Conflict(f"another tenant is named {name!r} (names are unique whatever their case)")
    return Conflict(
        f"tenant {holder.id} is named {holder.name!r}: names are unique whatever their case "
        "(rename or delete that tenant first)",
        details={"tenant_id": holder.id, "name": holder.name},
    )
