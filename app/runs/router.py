"""Tenant routes for runs (thin: parse, call the service, shape the response)."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response, status

from app.auth import SettingsDep, TenantDep
from app.db import SessionDep
from app.errors import Conflict, UnsupportedMediaType, raises
from app.http_semantics import JsonBodyRoute
from app.pagination import DEFAULT_LIMIT, CursorQuery, LimitQuery
from app.runs import service
from app.runs.admission import waiting_reason
from app.runs.deps import OwnedRunDep
from app.runs.idempotency import idempotency_key_header
from app.runs.schemas import (
    MAX_TOML_BODY_BYTES,
    EvictRequest,
    HeartbeatOut,
    InitFromRun,
    RunCreate,
    RunList,
    RunOut,
    parse_run_create,
)
from contracts.status import RunStatus

router = APIRouter(prefix="/v1/runs", tags=["runs"], route_class=JsonBodyRoute)


async def _raw_body(request: Request) -> bytes:
    # Read in the event loop, so the handler itself can be a plain (threadpool) function.
    return await request.body()


def _create_body_openapi() -> dict[str, Any]:
    # The body is parsed by hand (JSON or TOML), so document it explicitly. Nested models
    # are referenced from components, where RunOut.config puts them.
    schema = RunCreate.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    # init_from's model is in no response, so it is not in components: inline it.
    init_from = schema["properties"]["init_from"]
    init_from["anyOf"] = [InitFromRun.model_json_schema(), {"type": "null"}]
    toml_example = 'name = "gsm8k-r8"\n\n[config]\nmax_steps = 50\n\n[config.lora]\nrank = 8\n'
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": schema},
                "application/toml": {
                    "schema": {
                        "type": "string",
                        "description": f"At most {MAX_TOML_BODY_BYTES} bytes (else 413).",
                    },
                    "example": toml_example,
                },
            },
        }
    }


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    operation_id="createRun",
    responses={
        200: {"model": RunOut, "description": "Idempotent replay: the run created earlier with this key."}
    },
    openapi_extra=_create_body_openapi(),
)
@raises(Conflict, UnsupportedMediaType)
def create_run(
    principal: TenantDep,
    session: SessionDep,
    settings: SettingsDep,
    request: Request,
    response: Response,
    body: Annotated[bytes, Depends(_raw_body)],
    idempotency_key: Annotated[
        str | None,
        idempotency_key_header("Retry-safe creation: the same key and body return the same run."),
    ] = None,
) -> RunOut:
    """Create a run (JSON, or TOML with `Content-Type: application/toml`). It is `active`
    if it got a slot within its tenant's quota, else `queued`. `config.mode` `manual` is a 422:
    a Tinker training model's run is made by the Tinker API (create_model)."""
    # The key's lookup (on a cache miss) began this session's transaction: a pooled connection, and
    # on SQLite the database's write lock (BEGIN IMMEDIATE). It is ended before the body is parsed
    # (CPU time: tens of milliseconds at most for a TOML body), so other requests' writes go on
    # meanwhile and a refused body never held either; create_run begins its own. Nothing was written.
    session.commit()
    payload = parse_run_create(body, request.headers.get("content-type"))
    run, created = service.create_run(
        session,
        tenant_id=principal.tenant_id,
        api_key_id=principal.api_key_id,
        body=payload,
        idempotency_key=idempotency_key,
        settings=settings,
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    return RunOut.from_run(run)


@router.get("", operation_id="listRuns")
def list_runs(
    principal: TenantDep,
    session: SessionDep,
    status: RunStatus | None = None,
    limit: LimitQuery = DEFAULT_LIMIT,
    cursor: CursorQuery = None,
) -> RunList:
    """The caller's runs, newest first. Deleted runs are listed only with `status=deleted`."""
    runs, next_cursor = service.list_runs(
        session, tenant_id=principal.tenant_id, status=status, limit=limit, cursor=cursor
    )
    return RunList(items=[RunOut.from_run(r) for r in runs], next_cursor=next_cursor)


@router.get("/{run_id}", operation_id="getRun")
def get_run(run: OwnedRunDep, session: SessionDep, settings: SettingsDep) -> RunOut:
    """A run: state, slot, progress, timestamps, why and by whom it was evicted, and why it waits."""
    out = RunOut.from_run(run)
    if run.status == RunStatus.QUEUED:
        out.waiting_reason = waiting_reason(session, run=run, settings=settings)
    return out


@router.post("/{run_id}/evict", operation_id="evictRun")
@raises(Conflict)
def evict_run(
    run: OwnedRunDep, body: EvictRequest, principal: TenantDep, session: SessionDep, settings: SettingsDep
) -> RunOut:
    """Evict a queued or active run; its slot goes to the oldest queued run that fits."""
    by_orchestrator = body.by == "orchestrator"
    run = service.evict_run(
        session,
        run=run,
        reason=body.reason,
        evicted_by=body.by,
        actor="orchestrator" if by_orchestrator else "tenant",
        api_key_id=principal.api_key_id,
        settings=settings,
    )
    return RunOut.from_run(run)


@router.delete("/{run_id}", operation_id="deleteRun")
@raises(Conflict)
def delete_run(run: OwnedRunDep, principal: TenantDep, session: SessionDep, settings: SettingsDep) -> RunOut:
    """Delete a run (any state but deleted): frees its slot and removes its directory."""
    run = service.delete_run(
        session, run=run, actor="tenant", api_key_id=principal.api_key_id, settings=settings
    )
    return RunOut.from_run(run)


@router.post("/{run_id}/heartbeat", operation_id="runHeartbeat")
def heartbeat(run: OwnedRunDep, session: SessionDep) -> HeartbeatOut:
    """The orchestrator is alive (see the config's heartbeat_timeout). Answers the run's status,
    so an evicted run's orchestrator learns it here."""
    run = service.heartbeat(session, run=run)
    return HeartbeatOut(run_id=run.id, status=run.status, last_heartbeat_at=run.last_heartbeat_at)
