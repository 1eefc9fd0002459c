"""Pool routes for manual-mode work (the Tinker API): claim it, post its results."""

from fastapi import APIRouter
from pydantic import BaseModel

from app.auth import SettingsDep, WorkerDep
from app.db import SessionDep
from app.errors import Conflict, NotFound, raises
from app.http_semantics import JsonBodyRoute
from app.tinker import sampling, work
from contracts.tinker_work import ManualClaimIn, ManualClaimOut, ManualResultsIn

router = APIRouter(prefix="/v1/pool/manual", tags=["pool"], route_class=JsonBodyRoute)


class ManualResultsOut(BaseModel):
    recorded: int
    """How many of the posted results were recorded (a result for a future already done is not)."""


@router.post("/claim", operation_id="poolClaimManualWork")
@raises(NotFound, Conflict)
def claim_manual_work(
    _: WorkerDep, session: SessionDep, settings: SettingsDep, body: ManualClaimIn
) -> ManualClaimOut:
    # Up to half the items are kept for waiting base-model samples: they got only what the run work
    # left, and a claim full of it (64 small passes) left them none, round after round, until they
    # failed unclaimed. What neither takes goes to the other.
    kept = sampling.waiting_base_samples(session, pool_id=body.pool_id, at_most=body.max_items // 2)
    items = work.claim(
        session,
        pool_id=body.pool_id,
        max_items=body.max_items - kept,
        max_tokens=settings.tinker_max_tokens_per_round,
    )
    items += sampling.claim_base_samples(
        session,
        pool_id=body.pool_id,
        max_items=body.max_items - len(items),
        max_tokens=settings.tinker_max_tokens_per_round,
    )
    return ManualClaimOut(items=items)


@router.post("/results", operation_id="poolManualResults")
@raises(NotFound, Conflict)
def post_manual_results(_: WorkerDep, session: SessionDep, body: ManualResultsIn) -> ManualResultsOut:
    return ManualResultsOut(recorded=work.record_results(session, pool_id=body.pool_id, results=body.results))
