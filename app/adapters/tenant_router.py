"""Tenant routes of uploaded adapters: POST /v1/adapters (an uncompressed tar of a PEFT directory),
GET /v1/adapters, GET and DELETE /v1/adapters/{adapter_id} (thin: parse, call the service, shape)."""

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, status
from pydantic import AfterValidator, BaseModel

from app.adapters import uploads
from app.adapters.models import TenantAdapter
from app.adapters.pool_router import UploadBody
from app.adapters.upload import TAR_MEDIA_TYPE, require_tar
from app.auth import SettingsDep, TenantDep
from app.db import SessionDep
from app.errors import Conflict, NotFound, UnsupportedMediaType, ValidationFailed, raises
from app.runs.schemas import checked_run_name
from app.timestamps import UtcDatetime
from contracts.names import RUN_NAME_PATTERN, RUN_NAME_RULE
from contracts.run_config import DEFAULT_BASE_MODEL

router = APIRouter(tags=["adapters"])


AdapterName = Annotated[
    str,
    Query(
        min_length=1,
        max_length=128,
        description=f"The adapter's name: {RUN_NAME_RULE}.",
        json_schema_extra={"pattern": RUN_NAME_PATTERN},
    ),
    # The run names' rule: an uploaded adapter's name is listed and logged as a run's is (a newline
    # or a bidi override in it forged lines and reordered what a list showed).
    AfterValidator(checked_run_name),
]

AdapterIdPath = Annotated[
    str,
    Path(
        description="`adp_` + 12 lowercase hex digits.",
        examples=["adp_0123456789ab"],
        max_length=64,
        # Documented, not enforced: any other id is the same 404 as another tenant's adapter.
        json_schema_extra={"pattern": r"^adp_[0-9a-f]{12}$"},
    ),
]


@raises(UnsupportedMediaType)
async def _tar_upload(request: Request) -> None:  # no I/O: no thread
    """Refuse, before the body is read, an upload sent as another type than a tar (`require_tar`).
    A query parameter given twice is the request guard's 422 (app/request_guard.py)."""
    require_tar(request.headers.get("content-type"))


TarUpload = Annotated[None, Depends(_tar_upload)]


class TenantAdapterOut(BaseModel):
    id: str
    name: str
    base_model: str
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    sha256: str
    created_at: UtcDatetime

    @classmethod
    def of(cls, row: TenantAdapter) -> "TenantAdapterOut":
        return cls(
            id=row.id,
            name=row.name,
            base_model=row.base_model,
            rank=row.rank,
            alpha=row.alpha,
            target_modules=row.target_modules,
            size_bytes=row.size_bytes,
            sha256=row.sha256,
            created_at=row.created_at,
        )


class TenantAdapterList(BaseModel):
    items: list[TenantAdapterOut]


@router.post(
    "/v1/adapters",
    status_code=status.HTTP_201_CREATED,
    response_model=TenantAdapterOut,
    operation_id="uploadTenantAdapter",
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "Uncompressed tar holding exactly adapter_config.json and adapter_model.safetensors.",
            "content": {TAR_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
@raises(ValidationFailed, Conflict, NotFound)
def upload(
    principal: TenantDep,
    # Before the body is looked at (the request guard has read it, within the body budget).
    _: TarUpload,
    body: UploadBody,
    session: SessionDep,
    settings: SettingsDep,
    name: AdapterName = "adapter",
    base_model: Annotated[str, Query(min_length=1, max_length=256)] = DEFAULT_BASE_MODEL,
) -> TenantAdapterOut:
    row = uploads.upload_adapter(
        session, tenant_id=principal.tenant_id, name=name, base_model=base_model, body=body, settings=settings
    )
    return TenantAdapterOut.of(row)


@router.get("/v1/adapters", response_model=TenantAdapterList, operation_id="listTenantAdapters")
def list_adapters(principal: TenantDep, session: SessionDep) -> TenantAdapterList:
    rows = uploads.list_tenant_adapters(session, tenant_id=principal.tenant_id)
    return TenantAdapterList(items=[TenantAdapterOut.of(r) for r in rows])


@router.get("/v1/adapters/{adapter_id}", response_model=TenantAdapterOut, operation_id="getTenantAdapter")
@raises(NotFound)
def get_adapter(principal: TenantDep, adapter_id: AdapterIdPath, session: SessionDep) -> TenantAdapterOut:
    return TenantAdapterOut.of(
        uploads.get_tenant_adapter(session, tenant_id=principal.tenant_id, adapter_id=adapter_id)
    )


@router.delete(
    "/v1/adapters/{adapter_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    operation_id="deleteTenantAdapter",
    description="A 409 `adapter_in_use` while a run that has not loaded it yet starts from it (`init_from`): "
    "a queued run, or an active one without a checkpoint of its own; `details.run_ids` names them.",
)
@raises(NotFound, uploads.AdapterInUse)
def delete_adapter(
    principal: TenantDep, adapter_id: AdapterIdPath, session: SessionDep, settings: SettingsDep
) -> None:
    uploads.delete_tenant_adapter(
        session, tenant_id=principal.tenant_id, adapter_id=adapter_id, settings=settings
    )
