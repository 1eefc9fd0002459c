"""`GET /v1/pools`: what the live pools can train, for tenants (read-only).

A tenant sizes its runs from this before creating them: base model, vocabulary, the largest
LoRA rank, the modules adapted, the longest sample, and how many slots are taken. Pool ids,
world sizes and other tenants' runs are not shown.
"""

from fastapi import APIRouter
from pydantic import BaseModel, Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.auth import TenantDep
from app.db import SessionDep
from app.pools.models import Pool
from app.runs.models import Run
from contracts.status import PoolStatus, RunStatus

router = APIRouter(prefix="/v1/pools", tags=["pools"])


class LivePoolOut(BaseModel):
    base_model: str
    vocab_size: int = Field(description="Token ids of batches for this base model are in [0, vocab_size).")
    max_rank: int = Field(description="The largest lora.rank the pool trains.")
    target_modules: list[str] = Field(
        description="The modules the pool can adapt (lora.target_modules ⊆ these)."
    )
    seq_len: int = Field(description="The largest seq_len (prompt + completion tokens) the pool packs.")
    slots: int
    slots_used: int = Field(description="Runs active on the pool now (all tenants).")
    slots_free: int


class LivePoolList(BaseModel):
    items: list[LivePoolOut]


def live_pools(session: Session) -> list[LivePoolOut]:
    pools = session.scalars(
        select(Pool).where(Pool.status == PoolStatus.ALIVE).order_by(Pool.base_model, Pool.registered_at)
    ).all()
    used = dict(
        session.execute(
            select(Run.base_model, func.count())
            .where(Run.status == RunStatus.ACTIVE)
            .group_by(Run.base_model)
        ).all()
    )
    return [
        LivePoolOut(
            base_model=pool.base_model,
            vocab_size=pool.vocab_size,
            max_rank=pool.max_rank,
            target_modules=sorted(pool.target_modules),
            seq_len=pool.max_seq_len,
            slots=pool.slots,
            slots_used=min(used.get(pool.base_model, 0), pool.slots),
            slots_free=max(pool.slots - used.get(pool.base_model, 0), 0),
        )
        for pool in pools
    ]


@router.get("", operation_id="listPools")
def list_pools(_: TenantDep, session: SessionDep) -> LivePoolList:
    """The live worker pools: for each, the base model it serves and what it can train."""
    return LivePoolList(items=live_pools(session))
