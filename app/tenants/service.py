"""Tenants and API keys. Keyword-only, raises domain errors, never commits."""

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.auth import hash_key, new_api_key
from app.db import utcnow
from app.errors import Conflict, NotFound
from app.events.service import record_event
from app.tenants.models import ApiKey, Tenant
from contracts.ids import new_id

KEY_PREFIX_CHARS = 12
"""How much of a secret is kept in clear, so keys can be told apart ('llk_' + 8 characters)."""


def create_tenant(session: Session, *, name: str, max_concurrent_runs: int) -> Tenant:
    """A new tenant; a 409 if a tenant's name equals `name` whatever the case (`Acme` is `acme`)."""
    existing = tenant_named(session, name=name)
    if existing is not None:
        raise _name_taken(name, existing.name)
    tenant = Tenant(id=new_id("ten"), name=name, max_concurrent_runs=max_concurrent_runs)
    try:
        # A savepoint, so that losing a race on the unique name (uq_tenants_lower_name) is a 409,
        # not a broken transaction.
        with session.begin_nested():
            session.add(tenant)
    except IntegrityError as exc:
        raise _name_taken(name, None) from exc
    record_event(
        session,
        action="tenant.created",
        actor="admin",
        tenant_id=tenant.id,
        details={"name": name, "max_concurrent_runs": max_concurrent_runs},
    )
    return tenant


def tenant_named(session: Session, *, name: str, other_than: str | None = None) -> Tenant | None:
    """The tenant (other than `other_than`) whose name is `name` whatever the case
    (`uq_tenants_lower_name`)."""
    stmt = select(Tenant).where(func.lower(Tenant.name) == name.lower())
    return session.scalar(stmt if other_than is None else stmt.where(Tenant.id != other_than))


def _name_taken(name: str, existing: str | None) -> Conflict:
    """The 409 of a name taken; `existing` names the tenant's spelling where it differs in case."""
    if existing is None or existing == name:
        return Conflict(f"a tenant named {name!r} already exists")
    return Conflict(
        f"a tenant named {existing!r} already exists (names are unique whatever their case)",
        details={"name": existing},
    )


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.created_at, Tenant.id)))


def get_tenant(session: Session, *, tenant_id: str) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"tenant {tenant_id} not found")
    return tenant


def lock_tenant(session: Session, *, tenant_id: str) -> bool:
    """Lock the tenant's row until the transaction ends, serialising what must see the tenant's
    rows as they are (its uploaded adapters' quotas; deleting it). False if it is gone.

    FOR NO KEY UPDATE on Postgres: it excludes another holder of this lock, but not the KEY SHARE
    locks that inserting a row referencing the tenant takes (a batch's event, a Tinker future, a
    session). FOR UPDATE would block those: a transaction holding a run row and inserting such a
    row would wait for a tenant deletion that waits for that run row, a deadlock. SQLite ignores
    it, and needs nothing: every transaction there begins IMMEDIATE and holds the database's write
    lock (app/db.py). Lock order: after the admission lock and before run rows (app/runs/admission.py)."""
    locked = (
        select(Tenant.id).where(Tenant.id == tenant_id).with_for_update(key_share=True)
    )  # FOR NO KEY UPDATE
    return session.scalar(locked) is not None


def create_api_key(session: Session, *, tenant_id: str) -> tuple[ApiKey, str]:
    """A new key for the tenant; returns (row, secret). The secret is never stored or logged."""
    get_tenant(session, tenant_id=tenant_id)
    secret = new_api_key()
    key = ApiKey(
        id=new_id("key"), tenant_id=tenant_id, key_hash=hash_key(secret), prefix=secret[:KEY_PREFIX_CHARS]
    )
    session.add(key)
    session.flush()
    record_event(
        session, action="api_key.created", actor="admin", tenant_id=tenant_id, details={"key_id": key.id}
    )
    return key, secret


def list_api_keys(session: Session, *, tenant_id: str) -> list[ApiKey]:
    get_tenant(session, tenant_id=tenant_id)
    stmt = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
    return list(session.scalars(stmt))


def revoke_api_key(session: Session, *, tenant_id: str, key_id: str) -> ApiKey:
    """Revoke a key (idempotent: revoking a revoked key changes nothing)."""
    key = session.get(ApiKey, key_id)
    if key is None or key.tenant_id != tenant_id:
        raise NotFound(f"API key {key_id} not found for tenant {tenant_id}")
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        record_event(
            session, action="api_key.revoked", actor="admin", tenant_id=tenant_id, details={"key_id": key.id}
        )
    return key
