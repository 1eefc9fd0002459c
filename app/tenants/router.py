"""Admin routes: tenants and their API keys (thin: parse, call the service, shape the response)."""

from fastapi import APIRouter, Request, Response, status

from app.auth import AdminDep
from app.db import SessionDep
from app.key_cache import key_cache
from app.tenants import service
from app.tenants.schemas import ApiKeyCreated, TenantCreate, TenantList, TenantOut

router = APIRouter(prefix="/v1/tenants", tags=["tenants"])


@router.post("", status_code=status.HTTP_201_CREATED, operation_id="createTenant")
def create_tenant(body: TenantCreate, _: AdminDep, session: SessionDep) -> TenantOut:
    """Create a tenant with a quota of concurrent runs (admin)."""
    tenant = service.create_tenant(session, name=body.name, max_concurrent_runs=body.max_concurrent_runs)
    session.flush()
    return TenantOut.model_validate(tenant)


@router.get("", operation_id="listTenants")
def list_tenants(_: AdminDep, session: SessionDep) -> TenantList:
    """Every tenant, oldest first (admin)."""
    return TenantList(items=[TenantOut.model_validate(t) for t in service.list_tenants(session)])


@router.post("/{tenant_id}/keys", status_code=status.HTTP_201_CREATED, operation_id="createApiKey")
def create_api_key(tenant_id: str, _: AdminDep, session: SessionDep) -> ApiKeyCreated:
    """A new API key for the tenant; the secret `key` is in this response only (admin)."""
    key, secret = service.create_api_key(session, tenant_id=tenant_id)
    return ApiKeyCreated(
        id=key.id, tenant_id=key.tenant_id, key=secret, prefix=key.prefix, created_at=key.created_at
    )


@router.delete(
    "/{tenant_id}/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT, operation_id="revokeApiKey"
)
def revoke_api_key(
    tenant_id: str, key_id: str, _: AdminDep, session: SessionDep, request: Request
) -> Response:
    """Revoke an API key: requests with it get a 401 from now on (admin)."""
    service.revoke_api_key(session, tenant_id=tenant_id, key_id=key_id)
    # This process forgets its cached keys now; other processes within api_key_cache_seconds.
    key_cache(request.app.state, request.app.state.settings.api_key_cache_seconds).clear()
    return Response(status_code=status.HTTP_204_NO_CONTENT)
