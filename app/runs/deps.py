"""`OwnedRunDep`: the `{run_id}` of every tenant route under /v1/runs/{run_id}, resolved to the
caller's run.

A malformed id, a missing run and another tenant's run are the same 404 (another tenant's run is
never disclosed). As a dependency it runs before the body is read and validated, so another
tenant's run is a 404 whatever the body. Every router imports it from here, none from another router.
"""

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Path

from app.auth import TenantDep
from app.db import SessionDep
from app.errors import NotFound, raises
from app.runs.models import Run
from app.runs.service import get_run_for_tenant
from contracts.status import RunStatus

RunIdPath = Annotated[
    str,
    Path(
        description="`run_` + 12 lowercase hex digits.",
        examples=["run_0123456789ab"],
        max_length=64,
        # Documented, not enforced here: any other id is the same 404 as another tenant's run.
        json_schema_extra={"pattern": r"^run_[0-9a-f]{12}$"},
    ),
]


@raises(NotFound)
def get_owned_run(run_id: RunIdPath, principal: TenantDep, session: SessionDep) -> Run:
    return get_run_for_tenant(session, tenant_id=principal.tenant_id, run_id=run_id)


OwnedRunDep = Annotated[Run, Depends(get_owned_run)]


def refuse_if_run_deleted(run: Run, *, what: str) -> None:
    """The 404 of a deleted run's `what` (its adapters, metrics, batches). Their files went with the
    run's directory (`delete_run`), while their rows stay until the run is purged (app/retention.py):
    listings named steps whose every download was a 404, batches `pending` for good.
    `details.status` tells a client the run is deleted, not unknown (GET /v1/runs/{run_id} still
    shows the run, as `deleted`)."""
    if run.status == RunStatus.DELETED:
        raise NotFound(
            f"run {run.id} was deleted, and its {what} with it",
            details={"run_id": run.id, "status": RunStatus.DELETED.value},
        )


def undeleted_run(what: str) -> Callable[[Run], Coroutine[Any, Any, Run]]:
    """A dependency: the caller's run (`OwnedRunDep`), unless it was deleted: then its `what` are
    the 404 of `refuse_if_run_deleted`."""

    @raises(NotFound)
    async def run_with_its(run: OwnedRunDep) -> Run:  # no I/O: no thread
        refuse_if_run_deleted(run, what=what)
        return run

    return run_with_its
