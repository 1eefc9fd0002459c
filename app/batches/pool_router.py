"""Pool-facing batch routes: claim, ack, restart-from-checkpoint (worker token only)."""

from typing import Annotated

import msgspec
from fastapi import APIRouter, Header, Response

from app.auth import SettingsDep, WorkerDep
from app.batches import claims
from app.batches.schemas import MSGPACK_CONTENT_TYPES
from app.db import SessionDep, utcnow
from app.errors import Conflict, NotFound, raises
from app.http_semantics import JsonBodyRoute
from app.runs.deps import RunIdPath
from contracts.arrays import decode_stored, to_lists
from contracts.pool_api import (
    AckIn,
    AckOut,
    ClaimedBatchWire,
    ClaimIn,
    ClaimOut,
    ClaimStruct,
    RestartIn,
    RestartOut,
)

router = APIRouter(tags=["pool"], route_class=JsonBodyRoute)

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


def _as_json(stored: bytes) -> bytes:
    """A stored payload as the JSON of its list form (JSON claims are for people and tests)."""
    return _json_encoder.encode(to_lists(decode_stored(stored)))


@router.post(
    "/v1/pool/batches/claim",
    operation_id="claimBatches",
    response_model=ClaimOut,
    responses={
        200: {
            "description": "The leased batches with their payloads (msgpack instead of JSON with "
            "`Accept: application/msgpack`).",
            "content": {"application/msgpack": {"schema": {"$ref": "#/components/schemas/ClaimOut"}}},
        },
        404: {"description": "pool_not_found: the pool never registered; register first."},
        409: {"description": "The pool is dead or was replaced (pool_dead, pool_stopped); register again."},
    },
)
@raises(NotFound, Conflict)
def claim_batches(
    body: ClaimIn,
    _: WorkerDep,
    session: SessionDep,
    settings: SettingsDep,
    accept: Annotated[str | None, Header()] = None,
) -> Response:
    """Lease up to `max_batches` pending batches of active runs (fair across runs, each run's in id order),
    of the runs `run_ids` names when it is given."""
    claim = claims.claim_batches(
        session,
        settings=settings,
        pool_id=body.pool_id,
        max_batches=body.max_batches,
        now=utcnow(),
        run_ids=body.run_ids,
    )
    wants_msgpack = accept is not None and any(t in accept for t in MSGPACK_CONTENT_TYPES)
    # Encoded with msgspec rather than through the pydantic ClaimOut: ClaimStruct is the shape
    # ClaimOut documents, and the one the pool decodes. A msgpack claim splices each stored payload
    # in as its bytes (no decode, no re-encode); a JSON claim carries the list form.
    content = ClaimStruct(
        # The string msgspec writes for a datetime, so JSON and msgpack carry the same text.
        lease_expires_at=msgspec.to_builtins(claim.lease_expires_at),
        batches=[
            ClaimedBatchWire(
                id=item.batch.id,
                run_id=item.batch.run_id,
                slot=item.slot,
                sample_offset=item.batch.sample_offset,
                num_samples=item.batch.num_samples,
                rollout_step=item.batch.rollout_step,
                payload=msgspec.Raw(item.payload if wants_msgpack else _as_json(item.payload)),
            )
            for item in claim.items
        ],
    )
    if wants_msgpack:
        return Response(_msgpack_encoder.encode(content), media_type="application/msgpack")
    return Response(_json_encoder.encode(content), media_type="application/json")


@router.post(
    "/v1/pool/batches/ack",
    operation_id="ackBatches",
    response_model=AckOut,
    responses={
        409: {"description": "ack_rejected: a batch is unknown or not held by this pool (details name it)."}
    },
)
@raises(NotFound, Conflict)
def ack_batches(body: AckIn, _: WorkerDep, session: SessionDep) -> AckOut:
    """Mark batches trained, after the optimizer step that used them. All or nothing."""
    acked = claims.ack_batches(
        session,
        pool_id=body.pool_id,
        acks=[claims.AckRequest(batch_id=a.batch_id, trained_step=a.trained_step) for a in body.acks],
        now=utcnow(),
    )
    return AckOut(acked=acked)


@router.post(
    "/v1/pool/runs/{run_id}/restart",
    operation_id="restartRunFromCheckpoint",
    response_model=RestartOut,
    responses={404: {"description": "No such run."}, 409: {"description": "run_not_active."}},
)
@raises(NotFound, Conflict)
def restart_run_from_checkpoint(
    run_id: RunIdPath, body: RestartIn, _: WorkerDep, session: SessionDep
) -> RestartOut:
    """The pool restarts a run from a checkpoint: batches consumed after it (and claimed ones) return to
    pending and the run's progress is set back to the checkpoint's (DESIGN §4.3)."""
    returned = claims.restart_run_from_checkpoint(
        session,
        run_id=run_id,
        pool_id=body.pool_id,
        checkpoint_step=body.checkpoint_step,
        total_samples=body.total_samples,
        total_tokens=body.total_tokens,
    )
    return RestartOut(returned=returned)
