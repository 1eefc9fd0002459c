"""Pool-facing routes of what the trainer pushes back per run: adapters, step reports, checkpoint
commits, evictions (worker token only; thin: parse, call the service, shape the response)."""

import tempfile
from collections.abc import AsyncIterator
from typing import IO, Annotated

from fastapi import APIRouter, Depends, Request, status
from fastapi.responses import FileResponse

from app.adapters import service
from app.adapters.file_response import OpenFileResponse
from app.adapters.models import TenantAdapter
from app.adapters.schemas import CheckpointOut, StepParam
from app.adapters.upload import TAR_MEDIA_TYPE, require_tar
from app.adapters.uploads import open_archive
from app.auth import SettingsDep, WorkerDep
from app.db import SessionDep
from app.errors import Conflict, NotFound, UnsupportedMediaType, raises
from app.http_semantics import JsonBodyRoute
from app.runs.deps import RunIdPath
from app.runs.schemas import RunOut
from app.runs.service import get_run
from contracts.pool_api import AdapterStored, CheckpointReport, StepReport, TrainerEvict

router = APIRouter(tags=["pool"], route_class=JsonBodyRoute)

# Uploads up to this size stay in memory; larger ones spill to a temporary file.
_SPOOL_MEMORY_BYTES = 8 * 1024 * 1024


async def _upload_body(request: Request) -> AsyncIterator[IO[bytes]]:
    """The raw request body, streamed into a spooled file (the request guard caps its size), so
    the synchronous handler can read it as a file without holding a large adapter twice."""
    with tempfile.SpooledTemporaryFile(max_size=_SPOOL_MEMORY_BYTES) as spool:
        async for chunk in request.stream():
            spool.write(chunk)
        spool.seek(0)
        yield spool


UploadBody = Annotated[IO[bytes], Depends(_upload_body)]


@raises(UnsupportedMediaType)
async def _tar_media_type(request: Request) -> None:  # no I/O: no thread
    """The 415 of an adapter sent as another type than an uncompressed tar (`require_tar`), as the
    tenants' upload answers it: any body was read as a tar (a gzip got a 422 about a tar, a body of
    the right bytes under a wrong type a 201). The pool's client sends application/x-tar
    (trainer_core/service_client.py upload_adapter)."""
    require_tar(request.headers.get("content-type"))


TarMediaType = Annotated[None, Depends(_tar_media_type)]


@router.put(
    "/v1/pool/runs/{run_id}/adapters/{step}",
    status_code=status.HTTP_201_CREATED,
    response_model=AdapterStored,
    operation_id="uploadAdapter",
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "Uncompressed tar holding exactly adapter_config.json and adapter_model.safetensors.",
            "content": {TAR_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
@raises(NotFound, Conflict)
def upload_adapter(
    # The worker token first: dependencies resolve in order, and the body is only read once it passed.
    _: WorkerDep,
    # Then its type (before the run is looked up, or the body looked at), as on POST /v1/adapters.
    __: TarMediaType,
    run_id: RunIdPath,
    step: StepParam,
    body: UploadBody,
    session: SessionDep,
    settings: SettingsDep,
) -> AdapterStored:
    adapter = service.store_adapter(session, run_id=run_id, step=step, body=body, settings=settings)
    return AdapterStored(step=adapter.step, size_bytes=adapter.size_bytes, sha256=adapter.sha256)


@router.post("/v1/pool/runs/{run_id}/steps", response_model=RunOut, operation_id="reportStep")
@raises(NotFound, Conflict)
def report_step(
    run_id: RunIdPath, body: StepReport, session: SessionDep, settings: SettingsDep, _: WorkerDep
) -> RunOut:
    run = service.record_step(session, run_id=run_id, report=body, settings=settings)
    return RunOut.from_run(run)


@router.post(
    "/v1/pool/runs/{run_id}/checkpoints",
    status_code=status.HTTP_201_CREATED,
    response_model=CheckpointOut,
    operation_id="reportCheckpoint",
)
@raises(NotFound, Conflict)
def report_checkpoint(
    run_id: RunIdPath, body: CheckpointReport, session: SessionDep, _: WorkerDep
) -> CheckpointOut:
    ckpt = service.record_checkpoint(session, run_id=run_id, step=body.step, total_samples=body.total_samples)
    return CheckpointOut(
        run_id=ckpt.run_id, step=ckpt.step, total_samples=ckpt.total_samples, created_at=ckpt.created_at
    )


@router.post("/v1/pool/runs/{run_id}/evict", response_model=RunOut, operation_id="trainerEvictRun")
@raises(NotFound, Conflict)
def trainer_evict(
    run_id: RunIdPath, body: TrainerEvict, session: SessionDep, settings: SettingsDep, _: WorkerDep
) -> RunOut:
    run = service.evict_by_trainer(session, run_id=run_id, reason=body.reason, settings=settings)
    return RunOut.from_run(run)


@router.post("/v1/pool/runs/{run_id}/fail", response_model=RunOut, operation_id="trainerFailRun")
@raises(NotFound, Conflict)
def trainer_fail(
    run_id: RunIdPath, body: TrainerEvict, session: SessionDep, settings: SettingsDep, _: WorkerDep
) -> RunOut:
    """The pool cannot start the run (its `init_from` weights could not be loaded): `failed`, with
    `reason` as its `failure_reason`; a 409 once it has stopped."""
    run = service.fail_by_trainer(session, run_id=run_id, reason=body.reason, settings=settings)
    return RunOut.from_run(run)


@router.get(
    "/v1/pool/runs/{run_id}/init-adapter",
    response_class=FileResponse,
    operation_id="getInitAdapter",
    responses={
        200: {
            "content": {"application/gzip": {"schema": {"type": "string", "format": "binary"}}},
            "description": "tar.gz of the PEFT directory.",
        }
    },
)
@raises(NotFound)
def init_adapter(
    _: WorkerDep, run_id: RunIdPath, session: SessionDep, settings: SettingsDep
) -> OpenFileResponse:
    """The adapter a run starts from (its `init_from`), for the pool to load at admission."""
    run = get_run(session, run_id=run_id)
    uploaded = run.init_from.get("adapter_id") if run.init_from else None
    if uploaded is not None:
        if session.get(TenantAdapter, uploaded) is None:
            # The pool fails the run with this message as its reason: say what happened.
            raise NotFound(
                f"the uploaded adapter {uploaded} this run starts from was deleted", code="adapter_not_found"
            )
        return OpenFileResponse(
            open_archive(uploaded, settings), media_type="application/gzip", filename=f"{uploaded}.tar.gz"
        )
    if run.init_from is None or run.init_from.get("step") is None:
        raise NotFound(f"run {run_id} does not start from an adapter", code="adapter_not_found")
    adapter = service.get_adapter(
        session, run_id=run.init_from["run_id"], step=run.init_from["step"], kept=settings.run_adapters_kept
    )
    session.commit()  # the read ends: the archive may be built now (seconds; SQLite's write lock)
    return OpenFileResponse(
        service.open_adapter_archive(adapter, settings=settings),
        media_type="application/gzip",
        filename=f"{adapter.run_id}-step{adapter.step}.tar.gz",
    )
