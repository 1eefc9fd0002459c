"""Admin view of the worker pools: which are registered, alive, and what they can train."""

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select

from app.auth import AdminDep
from app.db import SessionDep
from app.pools.models import Pool
from app.timestamps import UtcDatetime

# Not /v1/pools: that is the tenants' read-only catalog of live pools (app/pools/catalog.py).
router = APIRouter(prefix="/v1/admin/pools", tags=["pools"])


class PoolOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    base_model: str
    status: str
    slots: int
    world_size: int
    max_rank: int
    max_seq_len: int
    target_modules: list[str]
    registered_at: UtcDatetime
    last_heartbeat_at: UtcDatetime


class PoolList(BaseModel):
    items: list[PoolOut]


@router.get("", operation_id="listAllPools")
def list_pools(_: AdminDep, session: SessionDep) -> PoolList:
    """Every pool that ever registered, newest first (admin)."""
    pools = session.scalars(select(Pool).order_by(Pool.registered_at.desc(), Pool.id))
    return PoolList(items=[PoolOut.model_validate(p) for p in pools])
