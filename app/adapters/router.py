"""Adapter, metrics and checkpoint routes: the trainer's pushes (worker token) and the
users' reads (API key). Thin: parse, call the service, shape the response."""

import tempfile
from collections.abc import AsyncIterator
from typing import IO, Annotated

from fastapi import APIRouter, Depends, Request, Response, status
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from app.adapters import service
from app.adapters.models import Adapter
from app.adapters.schemas import AdapterList, AdapterOut, CheckpointOut, MetricsItem, MetricsList
from app.auth import SettingsDep, TenantDep, TenantPrincipal, WorkerDep
from app.db import SessionDep
from app.errors import ValidationFailed
from app.runs.schemas import RunOut
from app.runs.service import get_run_for_tenant
from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from contracts.pool_api import AdapterStored, CheckpointReport, StepReport, TrainerEvict

router = APIRouter()

# Uploads up to this size stay in memory; larger ones spill to a temporary file.
_SPOOL_MEMORY_BYTES = 8 * 1024 * 1024

StepParam = Annotated[int, PathParam(ge=0, le=10_000_000)]


async def _upload_body(request: Request) -> AsyncIterator[IO[bytes]]:
    """The raw request body, streamed into a spooled file (BodySizeLimit caps its size), so
    the synchronous handler can read it as a file without holding a large adapter twice."""
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_MEMORY_BYTES) as spool:
        async for chunk in request.stream():
            spool.write(chunk)
        spool.seek(0)
        yield spool


UploadBody = Annotated[IO[bytes], Depends(_upload_body)]


# ---------------------------------------------------------------- worker pool


@router.put(
    "/v1/pool/runs/{run_id}/adapters/{step}",
    status_code=status.HTTP_201_CREATED,
    response_model=AdapterStored,
    operation_id="uploadAdapter",
    tags=["pool"],
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "Uncompressed tar holding exactly adapter_config.json and adapter_model.safetensors.",
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
def upload_adapter(
    # The worker token first: dependencies resolve in order, and the body is only read once it passed.
    _: WorkerDep,
    run_id: str,
    step: StepParam,
    body: UploadBody,
    session: SessionDep,
    settings: SettingsDep,
) -> AdapterStored:
    adapter = service.store_adapter(session, run_id=run_id, step=step, body=body, settings=settings)
    return AdapterStored(step=adapter.step, size_bytes=adapter.size_bytes, sha256=adapter.sha256)


@router.post("/v1/pool/runs/{run_id}/steps", response_model=RunOut, operation_id="reportStep", tags=["pool"])
def report_step(
    run_id: str, body: StepReport, session: SessionDep, settings: SettingsDep, _: WorkerDep
) -> RunOut:
    run = service.record_step(session, run_id=run_id, report=body, settings=settings)
    return RunOut.from_run(run)


@router.post(
    "/v1/pool/runs/{run_id}/checkpoints",
    status_code=status.HTTP_201_CREATED,
    response_model=CheckpointOut,
    operation_id="reportCheckpoint",
    tags=["pool"],
)
def report_checkpoint(
    run_id: str, body: CheckpointReport, session: SessionDep, _: WorkerDep
) -> CheckpointOut:
    ckpt = service.record_checkpoint(session, run_id=run_id, step=body.step, total_samples=body.total_samples)
    return CheckpointOut(
        run_id=ckpt.run_id, step=ckpt.step, total_samples=ckpt.total_samples, created_at=ckpt.created_at
    )


@router.post(
    "/v1/pool/runs/{run_id}/evict", response_model=RunOut, operation_id="trainerEvictRun", tags=["pool"]
)
def trainer_evict(
    run_id: str, body: TrainerEvict, session: SessionDep, settings: SettingsDep, _: WorkerDep
) -> RunOut:
    run = service.evict_by_trainer(session, run_id=run_id, reason=body.reason, settings=settings)
    return RunOut.from_run(run)


# ---------------------------------------------------------------- users


def _tenant_run_id(session: SessionDep, principal: TenantPrincipal, run_id: str) -> str:
    # Another tenant's run is a 404, never a 403: its existence is not disclosed.
    return get_run_for_tenant(session, tenant_id=principal.tenant_id, run_id=run_id).id


def _parse_step(step: str) -> int | None:
    """`latest` → None, a non-negative integer → itself; anything else is a 422."""
    if step == "latest":
        return None
    if step.isascii() and step.isdigit() and len(step) <= 9:
        return int(step)
    raise ValidationFailed(
        f"step must be a non-negative integer or 'latest', not {step!r}",
        details=[{"loc": ["path", "step"], "msg": "expected an integer or 'latest'", "type": "step_invalid"}],
    )


def _etag(adapter: Adapter) -> str:
    return f'"{adapter.sha256}"'


def _not_modified(request: Request, etag: str) -> bool:
    header = request.headers.get("if-none-match")
    if header is None:
        return False
    candidates = {c.strip().removeprefix("W/") for c in header.split(",")}
    return "*" in candidates or etag in candidates


def _adapter_headers(adapter: Adapter, etag: str | None) -> dict[str, str]:
    headers = {"X-Adapter-Step": str(adapter.step), "Cache-Control": "no-cache"}
    if etag is not None:
        headers["ETag"] = etag
    return headers


@router.get(
    "/v1/runs/{run_id}/adapters", response_model=AdapterList, operation_id="listAdapters", tags=["adapters"]
)
def list_adapters(run_id: str, session: SessionDep, principal: TenantDep) -> AdapterList:
    rid = _tenant_run_id(session, principal, run_id)
    return AdapterList(
        items=[
            AdapterOut(step=a.step, size_bytes=a.size_bytes, sha256=a.sha256, created_at=a.created_at)
            for a in service.list_adapters(session, run_id=rid)
        ]
    )


@router.get(
    "/v1/runs/{run_id}/adapters/{step}",
    operation_id="downloadAdapter",
    tags=["adapters"],
    response_class=FileResponse,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "tar.gz of the PEFT adapter directory"},
        304: {"description": "If-None-Match matched the adapter's ETag"},
    },
)
def download_adapter(
    run_id: str, step: str, request: Request, session: SessionDep, settings: SettingsDep, principal: TenantDep
) -> Response:
    rid = _tenant_run_id(session, principal, run_id)
    adapter = service.get_adapter(session, run_id=rid, step=_parse_step(step))
    etag = _etag(adapter)
    if _not_modified(request, etag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=_adapter_headers(adapter, etag))
    archive = service.adapter_archive(adapter, settings=settings)
    return FileResponse(
        archive,
        media_type="application/gzip",
        filename=f"{rid}_step_{adapter.step}.tar.gz",
        headers=_adapter_headers(adapter, etag),
    )


@router.get(
    "/v1/runs/{run_id}/adapters/{step}/files/{name}",
    operation_id="downloadAdapterFile",
    tags=["adapters"],
    response_class=FileResponse,
    responses={200: {"content": {"application/json": {}, "application/octet-stream": {}}}, 304: {}},
)
def download_adapter_file(
    run_id: str,
    step: str,
    name: str,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    principal: TenantDep,
) -> Response:
    rid = _tenant_run_id(session, principal, run_id)
    adapter = service.get_adapter(session, run_id=rid, step=_parse_step(step))
    path = service.adapter_file(adapter, name=name, settings=settings)
    # The sha256 is of the weights; the config file keeps Starlette's own (mtime, size) ETag.
    etag = _etag(adapter) if name == ADAPTER_WEIGHTS else None
    if etag is not None and _not_modified(request, etag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=_adapter_headers(adapter, etag))
    media_type = "application/json" if name == ADAPTER_CONFIG else "application/octet-stream"
    return FileResponse(path, media_type=media_type, filename=name, headers=_adapter_headers(adapter, etag))


@router.get(
    "/v1/runs/{run_id}/metrics", response_model=MetricsList, operation_id="getMetrics", tags=["adapters"]
)
def get_metrics(run_id: str, session: SessionDep, principal: TenantDep) -> MetricsList:
    rid = _tenant_run_id(session, principal, run_id)
    return MetricsList(
        items=[
            MetricsItem(step=m.step, created_at=m.created_at, **m.values)
            for m in service.list_metrics(session, run_id=rid)
        ]
    )
