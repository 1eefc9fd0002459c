"""Pool-facing routes: register, heartbeat, state (thin: parse, call the service, shape)."""

from fastapi import APIRouter, Query, status

from app.auth import SettingsDep, WorkerDep
from app.db import SessionDep
from app.errors import Conflict, NotFound, raises
from app.http_semantics import JsonBodyRoute
from app.pools import service
from contracts.pool_api import (
    DeletedRunsIn,
    DeletedRunsOut,
    PoolHeartbeatOut,
    PoolRef,
    PoolRegister,
    PoolRegistered,
    PoolRunState,
    PoolStateOut,
)
from contracts.progress import Progress

router = APIRouter(prefix="/v1/pool", tags=["pool"], route_class=JsonBodyRoute)


@router.post(
    "/register",
    status_code=status.HTTP_201_CREATED,
    response_model=PoolRegistered,
    operation_id="registerPool",
)
def register_pool(
    body: PoolRegister, session: SessionDep, settings: SettingsDep, _: WorkerDep
) -> PoolRegistered:
    pool, replaced = service.register_pool(session, spec=body, settings=settings)
    return PoolRegistered(
        pool_id=pool.id,
        heartbeat_interval_s=service.heartbeat_interval_s(settings),
        lease_seconds=settings.lease_seconds,
        replaced=replaced,
    )


@router.post("/heartbeat", response_model=PoolHeartbeatOut, operation_id="poolHeartbeat")
@raises(NotFound, Conflict)
def heartbeat(body: PoolRef, session: SessionDep, settings: SettingsDep, _: WorkerDep) -> PoolHeartbeatOut:
    pool = service.heartbeat_pool(session, pool_id=body.pool_id, settings=settings)
    return PoolHeartbeatOut(status=pool.status)


@router.post(
    "/deregister",
    response_model=PoolHeartbeatOut,
    operation_id="deregisterPool",
    responses={404: {"description": "No such pool (pool_not_found)."}},
)
def deregister(body: PoolRef, session: SessionDep, _: WorkerDep) -> PoolHeartbeatOut:
    """The pool is stopping: its leased batches return to pending at once (idempotent)."""
    pool = service.deregister_pool(session, pool_id=body.pool_id)
    return PoolHeartbeatOut(status=pool.status)


@router.get("/state", response_model=PoolStateOut, operation_id="getPoolState")
@raises(NotFound, Conflict)
def state(
    session: SessionDep,
    settings: SettingsDep,
    _: WorkerDep,
    pool_id: str = Query(min_length=1, max_length=32),
) -> PoolStateOut:
    runs = service.pool_state(session, pool_id=pool_id, settings=settings)
    return PoolStateOut(
        runs=[
            PoolRunState(
                run_id=run.id,
                slot=run.slot,
                status=run.status,
                config=run.config,
                progress=Progress(
                    step=run.step, total_tokens=run.total_tokens, total_samples=run.total_samples
                ),
                init_from=run.init_from,
            )
            for run in runs
        ]
    )


@router.post("/runs/deleted", response_model=DeletedRunsOut, operation_id="deletedPoolRuns")
def deleted_runs(body: DeletedRunsIn, session: SessionDep, _: WorkerDep) -> DeletedRunsOut:
    """Which of these runs this service holds as deleted: the pool removes their files from its own
    checkpoint directory (a run leaves the pool's state when it is evicted or completed too, and then
    keeps its checkpoints). A run deleted with its tenant is named too (its row went with the tenant,
    its id is kept, for the same retention as a deleted run's row). An id the service holds nothing
    for is never named (it may be another service's run). Read-only; any base model's runs (pools may
    share a checkpoint directory)."""
    return DeletedRunsOut(deleted=service.deleted_runs(session, run_ids=body.run_ids))
