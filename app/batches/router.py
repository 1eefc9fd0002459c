"""HTTP routes for batches (thin: parse, call the service, shape the response)."""

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from app.auth import SettingsDep
from app.batches import service
from app.batches.ingest_run import IngestRun
from app.batches.lean_route import LeanSubmitRoute
from app.batches.schemas import (
    JSON_CONTENT_TYPES,
    MSGPACK_CONTENT_TYPES,
    SUBMIT_BATCH_OPENAPI,
    BatchOut,
    BatchPage,
)
from app.db import SessionDep
from app.errors import Conflict, UnsupportedMediaType, raises
from app.pagination import CursorQuery, decode_id_cursor, encode_id_cursor
from app.runs.deps import OwnedRunDep, undeleted_run
from app.runs.idempotency import idempotency_key_header
from app.runs.models import Run
from contracts.pool_api import INT32_MAX
from contracts.status import BatchState

router = APIRouter(tags=["batches"])


async def _body(request: Request) -> bytes:
    return await request.body()


@raises(UnsupportedMediaType)
async def _is_msgpack(request: Request) -> bool:
    # async: no I/O here, so no trip through the threadpool.
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type in MSGPACK_CONTENT_TYPES:
        return True
    if media_type in JSON_CONTENT_TYPES or media_type.endswith("+json"):
        return False
    raise UnsupportedMediaType(
        f"unsupported Content-Type {media_type!r}; send application/json or application/msgpack",
        details={"content_type": media_type},
    )


@raises(Conflict)
def submit_batch(
    # First: an unauthenticated caller gets a 401 and another tenant's run a 404, whatever the body.
    run: OwnedRunDep,
    msgpack: Annotated[bool, Depends(_is_msgpack)],
    body: Annotated[bytes, Depends(_body)],
    session: SessionDep,
    settings: SettingsDep,
    response: Response,
    request: Request,
    idempotency_key: Annotated[
        str | None,
        idempotency_key_header(
            "Retries with the same key and body return the first batch (200); another body is a 409."
        ),
    ] = None,
) -> BatchOut:
    """Submit one rollout batch (a TrainingBatch as JSON or msgpack) to an active run.

    The 201 is sent only once the payload file is durable and the row committed."""
    vocab_size = service.vocab_size_for(session, base_model=run.base_model)
    result = service.submit_batch(
        session,
        settings=settings,
        run=IngestRun.of(run, vocab_size=vocab_size),
        body=body,
        msgpack=msgpack,
        idempotency_key=idempotency_key,
        full=service.full_runs(request.app.state),
    )
    if not result.created:
        response.status_code = 200
    return BatchOut.model_validate(result.batch)


# Registered here (before listBatches: the OpenAPI document keeps its order) with its own route
# class: the hot path skips the dependencies above (lean_route.py).
router.add_api_route(
    "/v1/runs/{run_id}/batches",
    submit_batch,
    methods=["POST"],
    route_class_override=LeanSubmitRoute,
    operation_id="submitBatch",
    status_code=201,
    response_model=BatchOut,
    openapi_extra=SUBMIT_BATCH_OPENAPI,
    responses={
        200: {
            "model": BatchOut,
            "description": "Replay: the batch stored earlier under this Idempotency-Key.",
        },
        404: {"description": "No such run (or another tenant's)."},
        409: {
            "description": "run_not_active, run_evicted (details: reason, evicted_by), stale_batch, "
            "idempotency_conflict, run_is_manual (a Tinker model's run: it takes no rollout batches)."
        },
        415: {"description": "Content-Type is neither JSON nor msgpack."},
        422: {
            "description": "Invalid batch; details: [{loc, msg, type, sample, field, problem}] (`sample`: "
            "the index in `examples` or null, `field`: the field at fault, `problem` = `msg`; a body "
            "refused before it is decoded, e.g. not UTF-8, lists `{loc, msg, type}` only). Nothing is stored."
        },
    },
)


# A deleted run's batch rows stay until the run is purged (app/retention.py), their payloads gone
# with its directory and the pending ones never to be trained: a 404, as its metrics and adapters.
RunWithBatchesDep = Annotated[Run, Depends(undeleted_run("batches"))]


@router.get("/v1/runs/{run_id}/batches", operation_id="listBatches", response_model=BatchPage)
def list_batches(
    run: RunWithBatchesDep,
    session: SessionDep,
    state: Annotated[BatchState | None, Query(description="Only batches in this state.")] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="Page size.")] = 50,
    cursor: CursorQuery = None,
) -> BatchPage:
    """The run's batches in id order (the order they are trained in), with their state.
    A deleted run's batches are a 404, as its metrics and adapters are."""
    after = None if cursor is None else decode_id_cursor(cursor, max_id=INT32_MAX)
    rows, next_id = service.list_batches(session, run_id=run.id, state=state, limit=limit, cursor=after)
    return BatchPage(
        items=[BatchOut.model_validate(r) for r in rows],
        next_cursor=None if next_id is None else encode_id_cursor(next_id),
    )
