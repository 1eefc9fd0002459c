"""Admin routes: tenants and their API keys (thin: parse, call the service, shape the response)."""

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response, status

from app.auth import AdminDep, SettingsDep
from app.db import SessionDep
from app.errors import Conflict, NotFound, ValidationFailed, problem, raises
from app.http_semantics import JsonBodyRoute
from app.key_cache import key_cache
from app.tenants import quota, removal, service
from app.tenants.schemas import (
    ApiKeyCreated,
    ApiKeyList,
    ApiKeyOut,
    TenantCreate,
    TenantList,
    TenantOut,
    TenantUpdate,
)

router = APIRouter(prefix="/v1/tenants", tags=["tenants"], route_class=JsonBodyRoute)

# Documented, not enforced: an id of another shape is simply not found (404).
TenantIdPath = Annotated[
    str,
    Path(max_length=64, examples=["ten_0123456789ab"], json_schema_extra={"pattern": r"^ten_[0-9a-f]{12}$"}),
]
KeyIdPath = Annotated[
    str,
    Path(max_length=64, examples=["key_0123456789ab"], json_schema_extra={"pattern": r"^key_[0-9a-f]{12}$"}),
]


@router.post("", status_code=status.HTTP_201_CREATED, operation_id="createTenant")
@raises(Conflict)
def create_tenant(body: TenantCreate, _: AdminDep, session: SessionDep) -> TenantOut:
    """Create a tenant with a quota of concurrent runs (admin)."""
    tenant = service.create_tenant(session, name=body.name, max_concurrent_runs=body.max_concurrent_runs)
    session.flush()
    return TenantOut.model_validate(tenant)


@router.get("", operation_id="listTenants")
def list_tenants(_: AdminDep, session: SessionDep) -> TenantList:
    """Every tenant, oldest first (admin)."""
    return TenantList(items=[TenantOut.model_validate(t) for t in service.list_tenants(session)])


@router.patch("/{tenant_id}", operation_id="updateTenant")
@raises(NotFound, Conflict)
def update_tenant(
    tenant_id: TenantIdPath, body: TenantUpdate, _: AdminDep, session: SessionDep, settings: SettingsDep
) -> TenantOut:
    """Change a tenant's quota of concurrent runs, its name, or both (admin). Lowered below its active
    runs, they keep their slots and its queued runs wait until it is under the new quota; raised, its
    queued runs that now fit are admitted at once. A name another tenant has whatever the case is a
    409 naming that tenant (`details.tenant_id`, `details.name`)."""
    if body.max_concurrent_runs is None and body.name is None:
        wanted = "give max_concurrent_runs, name or both"
        raise ValidationFailed(
            f"nothing to change: {wanted}",
            details=[
                problem(("body", field), wanted, "missing") for field in ("max_concurrent_runs", "name")
            ],
        )
    tenant = quota.update_tenant(
        session,
        tenant_id=tenant_id,
        max_concurrent_runs=body.max_concurrent_runs,
        name=body.name,
        settings=settings,
    )
    return TenantOut.model_validate(tenant)


@router.delete("/{tenant_id}", status_code=status.HTTP_204_NO_CONTENT, operation_id="deleteTenant")
@raises(NotFound)
def delete_tenant(
    tenant_id: TenantIdPath, _: AdminDep, session: SessionDep, settings: SettingsDep, request: Request
) -> Response:
    """Delete a tenant with its API keys and runs (each run deleted as by its owner: slot freed,
    files removed); the audit events stay (admin)."""
    removal.delete_tenant(session, tenant_id=tenant_id, settings=settings)
    # Committed first, then the cache cleared: a request reading the key after the clear finds it
    # gone, one that read it before cannot cache it (TtlCache.put's read_in). Its keys stop working
    # in this process now; in others within api_key_cache_seconds.
    session.commit()
    key_cache(request.app.state, settings.api_key_cache_seconds).clear()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{tenant_id}/keys", operation_id="listApiKeys")
@raises(NotFound)
def list_api_keys(tenant_id: TenantIdPath, _: AdminDep, session: SessionDep) -> ApiKeyList:
    """The tenant's API keys, revoked ones included; never the secrets (admin)."""
    return ApiKeyList(
        items=[ApiKeyOut.model_validate(k) for k in service.list_api_keys(session, tenant_id=tenant_id)]
    )


@router.post("/{tenant_id}/keys", status_code=status.HTTP_201_CREATED, operation_id="createApiKey")
@raises(NotFound)
def create_api_key(tenant_id: TenantIdPath, _: AdminDep, session: SessionDep) -> ApiKeyCreated:
    """A new API key for the tenant; the secret `key` is in this response only (admin)."""
    key, secret = service.create_api_key(session, tenant_id=tenant_id)
    return ApiKeyCreated(
        id=key.id, tenant_id=key.tenant_id, key=secret, prefix=key.prefix, created_at=key.created_at
    )


@router.delete(
    "/{tenant_id}/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT, operation_id="revokeApiKey"
)
@raises(NotFound)
def revoke_api_key(
    tenant_id: TenantIdPath, key_id: KeyIdPath, _: AdminDep, session: SessionDep, request: Request
) -> Response:
    """Revoke an API key: requests with it get a 401 from now on (admin)."""
    service.revoke_api_key(session, tenant_id=tenant_id, key_id=key_id)
    # Committed first, then the cache cleared (see delete_tenant): this process forgets the key now;
    # other processes within api_key_cache_seconds.
    session.commit()
    key_cache(request.app.state, request.app.state.settings.api_key_cache_seconds).clear()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
