"""Request and response bodies of the admin API (tenants and their API keys)."""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from app.timestamps import UtcDatetime
from contracts.run_config import JsonNumbers

TenantName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="Unique whatever the case ('Acme' is 'acme'); letters, digits, '.', '_', '-'.",
        examples=["acme"],
    ),
]
"""A tenant's name, at creation and at a rename alike."""


class TenantCreate(JsonNumbers):
    model_config = ConfigDict(extra="forbid")

    name: TenantName
    max_concurrent_runs: int = Field(
        default=2, ge=1, le=1024, description="Quota: runs holding a slot at once."
    )


class TenantUpdate(JsonNumbers):
    """What changes of a tenant: its quota, its name, or both (at least one; omitted or null is
    unchanged). A quota lowered below its active runs: they keep their slots, and its queued runs
    wait until fewer than the new quota are active. Raised: its queued runs that now fit are admitted
    at once (where their base models have free slots). A name another tenant has whatever the case
    is a 409 naming that tenant; another case of the tenant's own name is a rename."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_runs: int | None = Field(
        default=None, ge=1, le=1024, description="Quota: runs holding a slot at once."
    )
    name: TenantName | None = None


class TenantOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    max_concurrent_runs: int
    created_at: UtcDatetime


class TenantList(BaseModel):
    items: list[TenantOut]


class ApiKeyCreated(BaseModel):
    """A new API key. `key` is the secret: shown here once, stored only as a hash."""

    id: str
    tenant_id: str
    key: str
    prefix: str
    created_at: UtcDatetime


class ApiKeyOut(BaseModel):
    """An API key as listed: its id and the first characters of the secret, never the secret."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    tenant_id: str
    prefix: str
    created_at: UtcDatetime
    revoked_at: UtcDatetime | None


class ApiKeyList(BaseModel):
    items: list[ApiKeyOut]
