"""`OwnedRunDep`: the `{run_id}` of every tenant route under /v1/runs/{run_id}, resolved to the
caller's run.

A malformed id, a missing run and another tenant's run are the same 404 (another tenant's run is
never disclosed). As a dependency it runs before the body is read and validated, so another
tenant's run is a 404 whatever the body. Every router imports it from here, none from another router.
"""

from typing import Annotated

from fastapi import Depends, Path

from app.auth import TenantDep
from app.db import SessionDep
from app.errors import NotFound, raises
from app.runs.models import Run
from app.runs.service import get_run_for_tenant

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
