"""Deleting a tenant: its runs first (each as the tenant would delete it: slots freed, directories
removed after the commit), then the tenant, whose API keys, runs, batches and adapters rows go
with it (ON DELETE CASCADE), and the files of its uploaded adapters after the commit. The audit
trail (events) stays, and so do the ids of its runs (`DeletedRunId`, in the same transaction): a pool
with its own checkpoint directory asks which of its runs were deleted (`POST /v1/pool/runs/deleted`)
to remove their files, and the runs' rows are gone. Keyword-only, never commits."""

from sqlalchemy import insert, literal, select
from sqlalchemy.orm import Session

from app.adapters.models import TenantAdapter
from app.adapters.uploads import remove_upload_dirs
from app.config import Settings
from app.db import utcnow
from app.events.after_commit import call_after_commit
from app.events.service import record_event
from app.runs import service as runs_service
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.tenants.models import DeletedRunId
from app.tenants.service import get_tenant, lock_tenant
from contracts.status import RunStatus


def delete_tenant(session: Session, *, tenant_id: str, settings: Settings) -> int:
    """Delete the tenant and everything it owns; returns how many runs were deleted with it."""
    # In lock order (admission, then the tenant's row): no run is created for it, and no adapter
    # uploaded (app/adapters/uploads.py), between the reads below and the deletion.
    lock_admission(session)
    lock_tenant(session, tenant_id=tenant_id)
    tenant = get_tenant(session, tenant_id=tenant_id)  # a 404 if another deletion came first
    runs = list(
        session.scalars(
            select(Run).where(Run.tenant_id == tenant_id, Run.status != RunStatus.DELETED).order_by(Run.id)
        )
    )
    # Queued runs first: a deleted active run hands its slot to the oldest queued run, which must
    # not be one of this tenant's.
    runs.sort(key=lambda r: r.status != RunStatus.QUEUED)
    for run in runs:
        runs_service.delete_run(session, run=run, actor="admin", settings=settings)
    uploaded = list(session.scalars(select(TenantAdapter.id).where(TenantAdapter.tenant_id == tenant_id)))
    _keep_run_ids(session, tenant_id=tenant_id)
    record_event(
        session,
        action="tenant.deleted",
        actor="admin",
        tenant_id=tenant_id,
        details={"name": tenant.name, "runs_deleted": len(runs)},
    )
    session.delete(tenant)
    session.flush()
    # Not before the commit: a rolled-back deletion keeps the rows, which need their files.
    call_after_commit(session, lambda: remove_upload_dirs(uploaded, settings))
    return len(runs)


def _keep_run_ids(session: Session, *, tenant_id: str) -> None:
    """Every run of the tenant, those deleted before it included (their rows, kept for the retention,
    go with the tenant too), as deleted now: one INSERT ... SELECT however many runs it had. An id
    kept already (a run id is random, so only a collision) is left as it is."""
    session.flush()  # the runs' deletions above, before the SELECT reads them
    kept = select(DeletedRunId.run_id).where(DeletedRunId.run_id == Run.id)
    runs = select(Run.id, literal(utcnow(), DeletedRunId.deleted_at.type)).where(
        Run.tenant_id == tenant_id, ~kept.exists()
    )
    session.execute(insert(DeletedRunId).from_select(["run_id", "deleted_at"], runs))
