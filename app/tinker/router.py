"""The Tinker REST surface under /api/v1 (thin: parse, call the service, shape the answer).

Every route authenticates with the tenant's `tml-` key. Calls loraloom does not serve yet reach
the catch-all at the end and answer 400 `not supported by loraloom: <call>` (not retried by the
SDK, which raises it as a BadRequestError with that message).
"""

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session, sessionmaker

from app.auth import SettingsDep, cached_key
from app.db import SessionDep
from app.errors import MethodNotAllowed, RateLimited, UnsupportedMediaType, raises
from app.http_semantics import allowed_methods, require_json
from app.limits import InFlight
from app.tinker import checkpoints, sampling, service, work
from app.tinker.auth import TinkerTenantDep, tinker_key_hash, tinker_tenant
from app.tinker.long_polls import LongPolls
from app.tinker.models import TinkerFuture
from app.tinker.schemas import (
    MAX_ID_CHARS,
    MAX_SAMPLER_ID_CHARS,
    MAX_TINKER_PATH_CHARS,
    PRINTABLE,
    CheckpointsOut,
    ClientConfig,
    CreateModelRequest,
    CreateSessionRequest,
    Cursor,
    FutureRetrieveRequest,
    GetInfoRequest,
    GetInfoResponse,
    ServerCapabilities,
    SessionHeartbeatRequest,
    TrainingRunOut,
    TrainingRunsOut,
    TryAgain,
    UntypedAPIFuture,
    WeightsInfoOut,
    WeightsInfoRequest,
)

# The Tinker SDK's surface (its own protocol, documented by the SDK): not in our OpenAPI documents.
router = APIRouter(prefix="/api/v1", tags=["tinker"], include_in_schema=False)

# Path ids bounded as the bodies' are (app.tinker.schemas): a 422 naming the parameter, never a 404
# that repeats an id of any length (hostile probe h1, finding 8).
ModelIdPath = Annotated[str, Path(max_length=MAX_ID_CHARS, pattern=PRINTABLE)]
SessionIdPath = Annotated[str, Path(max_length=MAX_ID_CHARS, pattern=PRINTABLE)]
SamplerIdPath = Annotated[str, Path(max_length=MAX_SAMPLER_ID_CHARS, pattern=PRINTABLE)]
CheckpointIdPath = Annotated[str, Path(max_length=MAX_TINKER_PATH_CHARS, pattern=PRINTABLE)]


@raises(UnsupportedMediaType)
async def json_body(_: TinkerTenantDep, request: Request) -> None:
    """Every route that reads a JSON body takes it as JSON only: a body of another Content-Type, or
    of none, is a 415 naming application/json (FastAPI validated it as bytes: a 422 saying the body
    is not an object), after the caller's 401, as on /v1. The official SDK sends application/json on
    every call (application/x-protobuf to forward_backward, which reads its own body). The caller is
    the route's own (FastAPI resolves a dependency once a request); the body was read already."""
    require_json(request.headers.get("content-type"), has_body=bool(await request.body()))


JSON_BODY = [Depends(json_body)]


@router.get("/healthz", operation_id="tinkerHealthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config", operation_id="tinkerClientConfig")
def client_config(_: TinkerTenantDep, settings: SettingsDep) -> ClientConfig:
    return ClientConfig.for_limits(
        max_datums=work.MAX_DATUMS_PER_REQUEST, max_tokens=settings.tinker_max_tokens_per_round
    )


@router.post("/client/dynamic_config", operation_id="tinkerClientDynamicConfig")
def client_dynamic_config(_: TinkerTenantDep) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry", operation_id="tinkerTelemetry")
def telemetry(_: TinkerTenantDep) -> dict[str, str]:
    # The SDK reports its own events here; loraloom has its own event stream and keeps none of them.
    return {"status": "accepted"}


@router.post("/create_session", operation_id="tinkerCreateSession", dependencies=JSON_BODY)
def create_session(
    principal: TinkerTenantDep, session: SessionDep, settings: SettingsDep, body: CreateSessionRequest
) -> dict[str, str]:
    row = service.create_session(session, tenant_id=principal.tenant_id, body=body, settings=settings)
    return {"type": "create_session", "session_id": row.id}


@router.post("/session_heartbeat", operation_id="tinkerSessionHeartbeat", dependencies=JSON_BODY)
def session_heartbeat(
    principal: TinkerTenantDep, session: SessionDep, body: SessionHeartbeatRequest
) -> dict[str, str]:
    service.heartbeat(session, tenant_id=principal.tenant_id, session_id=body.session_id)
    return {"type": "session_heartbeat"}


@router.post(
    "/sessions/{session_id}/finish",
    status_code=status.HTTP_204_NO_CONTENT,
    operation_id="tinkerFinishSession",
)
def finish_session(principal: TinkerTenantDep, session: SessionDep, session_id: SessionIdPath) -> Response:
    service.finish_session(session, tenant_id=principal.tenant_id, session_id=session_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/get_server_capabilities", operation_id="tinkerServerCapabilities")
def get_server_capabilities(_: TinkerTenantDep, session: SessionDep) -> ServerCapabilities:
    return ServerCapabilities(supported_models=service.capabilities(session))


@router.post("/create_model", operation_id="tinkerCreateModel", dependencies=JSON_BODY)
def create_model(
    principal: TinkerTenantDep, session: SessionDep, settings: SettingsDep, body: CreateModelRequest
) -> UntypedAPIFuture:
    future = service.create_model(
        session, tenant_id=principal.tenant_id, api_key_id=principal.api_key_id, body=body, settings=settings
    )
    return UntypedAPIFuture(request_id=future.id, model_id=future.model_id)


@router.post("/get_info", operation_id="tinkerGetInfo", dependencies=JSON_BODY)
def get_info(principal: TinkerTenantDep, session: SessionDep, body: GetInfoRequest) -> GetInfoResponse:
    return service.model_info(session, tenant_id=principal.tenant_id, model_id=body.model_id)


LONG_POLL_S = 2.0
"""How long retrieve_future waits for a pending result before answering "try again": the SDK
polls again at once on that answer, so the wait (not the SDK) sets the polling rate."""
POLL_INTERVAL_S = 0.05
MAX_POLL_INTERVAL_S = 0.4
"""The checks of one long poll start POLL_INTERVAL_S apart and double up to this: a result that is
quick comes back quickly, and a future that waits for the pool (seconds, usually) costs 8 checks per
long poll instead of 40 (the SDK polls every pending future at once: a tenant with a hundred of them
made the service run 2,000 checks a second)."""


def _answer(future: TinkerFuture) -> Response | None:
    """What retrieve_future says about a future; None while it is pending."""
    if future.status in (work.PENDING, work.RUNNING):
        return None
    if future.status == "failed":
        return JSONResponse({"error": future.error, "category": future.error_category or "unknown"})
    if future.kind in ("forward", "forward_backward"):
        # This SDK reads ForwardBackwardOutput and SampleResponse only as protobuf.
        return Response(work.forward_backward_proto(future.result or {}), media_type="application/x-protobuf")
    if future.kind == "sample":
        return Response(sampling.sample_proto(future.result or {}), media_type="application/x-protobuf")
    return JSONResponse({k: v for k, v in (future.result or {}).items() if not k.startswith("loraloom_")})


LONG_POLL_WAIT_S = 10.0
"""How long a long poll past `Settings.tinker_max_long_polls_per_tenant` waits in line for a place
before answering "try again" (app.tinker.long_polls; the SDK then polls again at once, joining the
line's end). The places turn over every LONG_POLL_S at the latest, so the first 5 x the cap in line
get one; far inside the SDK's 45 s timeout, and a bound on how long a server stopping waits for a
poll in line."""
LONG_POLL_RETRY_AFTER_SECONDS = 1
"""Retry-After of a long poll refused because its tenant's line is full. The SDK's retrieve loop
backs off on a 429 by itself (1, 2, 4 ... up to 30 s, reset by its next answer) and polls again:
the future is not lost, its result only comes later."""


def long_polls(request: Request) -> LongPolls:
    """The app's places and lines of each tenant's long polls (made on first use; route handlers
    that call this run on the event loop, one at a time, so it is made once). The line holds at
    most `tinker_max_pending_per_tenant` polls: an honest SDK polls each of its futures once at a
    time, and a tenant has no more than that many waiting for the pool."""
    state = request.app.state
    polls: LongPolls | None = getattr(state, "tinker_long_polls", None)
    if polls is None:
        settings = state.settings
        polls = LongPolls(
            settings.tinker_max_long_polls_per_tenant,
            most_waiting=settings.tinker_max_pending_per_tenant,
            retry_after=LONG_POLL_RETRY_AFTER_SECONDS,
        )
        state.tinker_long_polls = polls
    return polls


def _authenticate(factory: sessionmaker[Session], request: Request) -> str:
    with factory() as session, session.begin():
        return tinker_tenant(session, request).tenant_id


def _retrieve_once(factory: sessionmaker[Session], *, request: Request, request_id: str) -> Response | None:
    # Authenticates in its own transaction: this route holds no session across the wait (on
    # SQLite a second one would wait for the first's write lock). Every check does, so a revoked
    # key stops within the key cache's bound.
    with factory() as session, session.begin():
        tenant_id = tinker_tenant(session, request).tenant_id
        future = service.get_future(session, tenant_id=tenant_id, request_id=request_id)
        work.fail_if_run_left(session, future=future)
        service.check_named_model(session, future=future)  # a deleted model's save: 404, no path
        return _answer(future)


async def _check(
    factory: sessionmaker[Session], *, request: Request, request_id: str, tenant_id: str
) -> Response | None:
    """One check of a long poll, holding one of the tenant's in-flight places while it runs (its
    thread and database connection). With none free, the check is skipped (None: still pending),
    and the poll waits for its next: the tenant's own requests fill its places, never another's."""
    in_flight: InFlight = request.app.state.in_flight
    try:
        in_flight.acquire(tenant_id)
    except RateLimited:
        return None
    try:
        return await run_in_threadpool(_retrieve_once, factory, request=request, request_id=request_id)
    finally:
        in_flight.release(tenant_id)


def _try_again_once(
    factory: sessionmaker[Session], *, request: Request, request_id: str, tenant_id: str
) -> TryAgain:
    # The poll's last check authenticated the key a moment ago; this reads the tenant's own future.
    with factory() as session, session.begin():
        future = service.get_future(session, tenant_id=tenant_id, request_id=request_id)
        state, reason = service.queue_state(session, future=future, settings=request.app.state.settings)
        return TryAgain(request_id=request_id, queue_state=state, queue_state_reason=reason)


async def _try_again(
    factory: sessionmaker[Session], *, request: Request, request_id: str, tenant_id: str
) -> Response:
    """The "try again" that ends a long poll, with why the future waits when its run is queued
    (`service.queue_state`): read once per poll, not at every check. Holds one of the tenant's
    in-flight places as a check does; with none free it answers a plain "try again"."""
    in_flight: InFlight = request.app.state.in_flight
    try:
        in_flight.acquire(tenant_id)
    except RateLimited:
        return JSONResponse(TryAgain(request_id=request_id).model_dump())
    try:
        answer = await run_in_threadpool(
            _try_again_once, factory, request=request, request_id=request_id, tenant_id=tenant_id
        )
    finally:
        in_flight.release(tenant_id)
    return JSONResponse(answer.model_dump(exclude_none=True))


async def _poll_tenant(request: Request) -> str:
    """The caller of a long poll. The key caches answer a known key (or a recent wrong one) on the
    event loop: no thread. A dependency, so a caller is refused (401) before its body is looked at."""
    cached = cached_key(request.app.state, tinker_key_hash(request))
    if cached is not None:
        return cached.tenant_id
    return await run_in_threadpool(_authenticate, request.app.state.session_factory, request)


@raises(UnsupportedMediaType)
async def _poll_json_body(tenant_id: Annotated[str, Depends(_poll_tenant)], request: Request) -> str:
    """`json_body` of the long poll, which holds no session (its own `_poll_tenant`)."""
    require_json(request.headers.get("content-type"), has_body=bool(await request.body()))
    return tenant_id


@router.post("/retrieve_future", operation_id="tinkerRetrieveFuture")
async def retrieve_future(
    request: Request, tenant_id: Annotated[str, Depends(_poll_json_body)], body: FutureRetrieveRequest
) -> Response:
    """The result; `{"error", "category"}` for a failed request; `{"type": "try_again"}` if it
    is still pending after a short long-poll (the SDK then polls again), with `queue_state` and
    `queue_state_reason` saying why when its run waits for a place (`_try_again`); 404 `model ... not found`
    for a save (or a model's creation or load) whose model's run is deleted
    (`service.check_named_model`). Each check is its own short transaction in the threadpool; the
    wait between checks holds no thread.

    At most `Settings.tinker_max_long_polls_per_tenant` polls of a tenant check at once (the
    others wait in line for a place, on the event loop only: app.tinker.long_polls), and each check
    holds one of its `tenant_max_in_flight` places: uncounted, 300 polls of one tenant took the
    threadpool and the database connections, and another tenant's requests went from 12 ms to 1.2 s
    (hostile probe, finding 4). A poll whose client has gone ends at its next check, or before its
    first when it waited in line, freeing its place."""
    factory: sessionmaker[Session] = request.app.state.session_factory
    polls = long_polls(request)
    if not await polls.enter(tenant_id, wait_s=LONG_POLL_WAIT_S):
        # No place came up: "try again" (the SDK polls again at once; it backs off from a 429).
        return JSONResponse(TryAgain(request_id=body.request_id).model_dump())
    try:
        if await request.is_disconnected():  # gone while it waited in line: no check for nobody
            return Response(status_code=status.HTTP_204_NO_CONTENT)
        deadline = time.monotonic() + LONG_POLL_S
        interval = POLL_INTERVAL_S
        while True:
            answer = await _check(factory, request=request, request_id=body.request_id, tenant_id=tenant_id)
            if answer is not None:
                return answer
            if time.monotonic() >= deadline:
                return await _try_again(
                    factory, request=request, request_id=body.request_id, tenant_id=tenant_id
                )
            await asyncio.sleep(interval)
            if await request.is_disconnected():
                return Response(status_code=status.HTTP_204_NO_CONTENT)  # nobody reads it
            interval = min(2 * interval, MAX_POLL_INTERVAL_S)
    finally:
        polls.leave(tenant_id)


async def _raw_body(request: Request) -> bytes:
    return await request.body()


@router.post("/forward_backward", operation_id="tinkerForwardBackward")
def forward_backward(
    principal: TinkerTenantDep,
    session: SessionDep,
    settings: SettingsDep,
    body: Annotated[bytes, Depends(_raw_body)],
) -> UntypedAPIFuture:
    """A protobuf `ForwardBackwardRequest` (forward_only for `forward`), queued for the pool."""
    future = work.submit_forward_backward(
        session, tenant_id=principal.tenant_id, body=body, settings=settings
    )
    return UntypedAPIFuture(request_id=future.id, model_id=future.model_id)


@router.post("/optim_step", operation_id="tinkerOptimStep", dependencies=JSON_BODY)
def optim_step(
    principal: TinkerTenantDep, session: SessionDep, settings: SettingsDep, body: dict[str, Any]
) -> UntypedAPIFuture:
    future = work.submit_optim_step(session, tenant_id=principal.tenant_id, body=body, settings=settings)
    return UntypedAPIFuture(request_id=future.id, model_id=future.model_id)


@router.post("/save_weights_for_sampler", operation_id="tinkerSaveWeightsForSampler", dependencies=JSON_BODY)
def save_weights_for_sampler(
    principal: TinkerTenantDep, session: SessionDep, settings: SettingsDep, body: dict[str, Any]
) -> UntypedAPIFuture:
    """Names the adapter of the model's step at this point of its request order (every
    optim_step publishes one): `tinker://{model_id}/sampler_weights/{name}`. A tenant keeps at most
    `Settings.tinker_max_sampler_checkpoints_per_tenant` of them live (403 `save_quota` past it:
    `checkpoints.check_sampler_quota`)."""
    future = work.submit_save_for_sampler(
        session, tenant_id=principal.tenant_id, body=body, settings=settings
    )
    return UntypedAPIFuture(request_id=future.id, model_id=future.model_id)


@router.post("/save_weights", operation_id="tinkerSaveWeights", dependencies=JSON_BODY)
def save_weights(
    principal: TinkerTenantDep, session: SessionDep, settings: SettingsDep, body: dict[str, Any]
) -> UntypedAPIFuture:
    """save_state: adapter and optimizer state by name, `tinker://{model_id}/weights/{name}`."""
    future = work.submit_save_weights(session, tenant_id=principal.tenant_id, body=body, settings=settings)
    return UntypedAPIFuture(request_id=future.id, model_id=future.model_id)


@router.post("/load_weights", operation_id="tinkerLoadWeights", dependencies=JSON_BODY)
def load_weights(
    principal: TinkerTenantDep, session: SessionDep, settings: SettingsDep, body: dict[str, Any]
) -> UntypedAPIFuture:
    future = work.submit_load_weights(
        session, tenant_id=principal.tenant_id, api_key_id=principal.api_key_id, body=body, settings=settings
    )
    return UntypedAPIFuture(request_id=future.id, model_id=future.model_id)


@router.post("/create_sampling_session", operation_id="tinkerCreateSamplingSession", dependencies=JSON_BODY)
def create_sampling_session(
    principal: TinkerTenantDep, session: SessionDep, body: dict[str, Any]
) -> dict[str, str]:
    sampler = sampling.create_sampling_session(session, tenant_id=principal.tenant_id, body=body)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.id}


@router.get("/samplers/{sampler_id}", operation_id="tinkerGetSampler")
def get_sampler(principal: TinkerTenantDep, session: SessionDep, sampler_id: SamplerIdPath) -> dict[str, str]:
    sampler = sampling.get_sampling_session(session, tenant_id=principal.tenant_id, sampler_id=sampler_id)
    answer = {"sampler_id": sampler.id, "base_model": sampler.base_model}
    return answer if sampler.model_path is None else {**answer, "model_path": sampler.model_path}


@router.post("/asample", operation_id="tinkerSample", dependencies=JSON_BODY)
def asample(
    principal: TinkerTenantDep, session: SessionDep, settings: SettingsDep, body: dict[str, Any]
) -> UntypedAPIFuture:
    """Served by the pool with the run's adapter, batched with every tenant's work."""
    future = sampling.submit_sample(
        session,
        tenant_id=principal.tenant_id,
        body=body,
        settings=settings,
    )
    n = int((future.request or {}).get("sampling", {}).get("num_samples", 1))
    return UntypedAPIFuture(request_id=future.id, sample_sequence_ids=[f"{future.id}-{i}" for i in range(n)])


@router.get("/loraloom/resolve", operation_id="tinkerResolvePath")
def resolve_path(
    principal: TinkerTenantDep,
    session: SessionDep,
    path: Annotated[str, Query(max_length=MAX_TINKER_PATH_CHARS, pattern=PRINTABLE)],
) -> dict[str, Any]:
    """loraloom's own route: which run adapter a `tinker://` sampler path names, and where to
    download it (GET /v1/runs/{run_id}/adapters/{step}, with the tenant's Bearer key)."""
    run_id, step = work.resolve_sampler_path(session, tenant_id=principal.tenant_id, path=path)
    return {"run_id": run_id, "step": step, "adapter_url": f"/v1/runs/{run_id}/adapters/{step}"}


@router.get("/training_runs", operation_id="tinkerListTrainingRuns")
def list_training_runs(
    principal: TinkerTenantDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> TrainingRunsOut:
    items, total = service.list_training_runs(
        session, tenant_id=principal.tenant_id, limit=limit, offset=offset
    )
    items = checkpoints.with_latest_checkpoints_of(session, tenant_id=principal.tenant_id, run_outs=items)
    return TrainingRunsOut(training_runs=items, cursor=Cursor(offset=offset, limit=limit, total_count=total))


@router.get("/training_runs/{training_run_id}", operation_id="tinkerGetTrainingRun")
def get_training_run(
    principal: TinkerTenantDep, session: SessionDep, training_run_id: ModelIdPath
) -> TrainingRunOut:
    """Also what `get_training_run_by_tinker_path` asks for (the SDK parses the path itself). A
    model whose run is deleted is a 404, as an unknown one (`service.get_listed_model`)."""
    model, run = service.get_listed_model(session, tenant_id=principal.tenant_id, model_id=training_run_id)
    return checkpoints.with_latest_checkpoints(
        session, tenant_id=principal.tenant_id, run_out=service.training_run_out(model, run)
    )


@router.get("/training_runs/{training_run_id}/checkpoints", operation_id="tinkerListCheckpoints")
def list_checkpoints(
    principal: TinkerTenantDep, session: SessionDep, training_run_id: ModelIdPath
) -> CheckpointsOut:
    items = checkpoints.model_checkpoints(session, tenant_id=principal.tenant_id, model_id=training_run_id)
    return CheckpointsOut(checkpoints=items)


@router.delete(
    "/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}",
    status_code=status.HTTP_204_NO_CONTENT,
    operation_id="tinkerDeleteCheckpoint",
)
def delete_checkpoint(
    principal: TinkerTenantDep,
    session: SessionDep,
    training_run_id: ModelIdPath,
    checkpoint_id: CheckpointIdPath,
) -> Response:
    """`checkpoint_id` is `weights/<name>` or `sampler_weights/<name>` (it holds a slash)."""
    if checkpoint_id.endswith("/publish"):
        raise service.NotSupported("unpublishing checkpoints (loraloom does not publish them)")
    checkpoints.delete_checkpoint(
        session, tenant_id=principal.tenant_id, model_id=training_run_id, checkpoint_id=checkpoint_id
    )
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/checkpoints", operation_id="tinkerListUserCheckpoints")
def list_user_checkpoints(
    principal: TinkerTenantDep,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> CheckpointsOut:
    items, total = checkpoints.user_checkpoints(
        session, tenant_id=principal.tenant_id, limit=limit, offset=offset
    )
    return CheckpointsOut(checkpoints=items, cursor=Cursor(offset=offset, limit=limit, total_count=total))


@router.post("/weights_info", operation_id="tinkerWeightsInfo", dependencies=JSON_BODY)
def weights_info(principal: TinkerTenantDep, session: SessionDep, body: WeightsInfoRequest) -> WeightsInfoOut:
    return checkpoints.weights_info(session, tenant_id=principal.tenant_id, path=body.tinker_path)


class TinkerMethodNotAllowed(MethodNotAllowed):
    """405 with the `Allow` header (RFC 9110 §15.5.6) of a served Tinker route asked with another
    method: the catch-all below takes every path, so Starlette's own 405 never comes."""

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.allow = allow

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Allow": self.allow}


@router.api_route("/{call:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
def not_supported(_: TinkerTenantDep, request: Request, call: str) -> None:
    """400 `not supported by loraloom` for a call loraloom does not serve; 405 naming the methods
    for a path it serves with others (`GET /api/v1/create_session` said "not supported", which
    reads as a missing feature)."""
    # Not this route, nor one whose last parameter takes any tail (`{checkpoint_id:path}`): that
    # one matches `.../checkpoints/<id>/publish` too, which is publishing, a call not served.
    served = [
        route
        for route in router.routes
        if getattr(route, "endpoint", None) is not not_supported
        and ":path}" not in getattr(route, "path", "")
    ]
    allow = allowed_methods(served, request.scope)
    if allow is not None:
        raise TinkerMethodNotAllowed(
            f"{request.method} is not allowed on /api/v1/{call}; allowed: {allow}", allow=allow
        )
    raise service.NotSupported(f"{request.method} /api/v1/{call}")
