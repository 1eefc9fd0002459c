"""The batch-submission route's fast path: the hot request of the service, handled without
FastAPI's dependency solving and response-model work, in one trip through the thread pool.
The front layer (app/front.py) calls `fast_response` straight after the request guard, without
the exception-handler and routing layers; a request that reaches the route (the front layer
declined it, or an app built otherwise) gets the same fast path from the route's handler.

`LeanSubmitRoute` is the route class of `POST /v1/runs/{run_id}/batches` only. Its endpoint,
dependencies and OpenAPI document are those of the declared route (app/batches/router.py); only
the handler changes. A request takes the fast path when everything FastAPI would check before the
endpoint is known to pass without the database:

- the bearer key is a valid key in the short-lived key cache (app/key_cache.py), which holds only
  valid keys, so the documented route's lookup would find the same tenant;
- the Content-Type is JSON or msgpack;
- the Idempotency-Key, if any, is one the route declares (app/runs/idempotency.py); the run id fits
  its 64 characters.

Anything else (no or an unknown key, a cache miss, a bad header: every 401, 415 and 422 of the
route) goes to the documented handler, which answers as it always did (and fills the key cache;
so does the request guard's lookup of a large body's key, app/request_guard.py).
On the fast path the checks that remain run in the same order as the dependencies: the tenant's
in-flight limit (429), then the run (404, another tenant's included), then the service, whose
errors the app's handlers turn into the uniform body. The session is committed before the
response is built, as SessionDep does, so a 2xx still means the row is durable.
"""

import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute, APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from app.auth import hash_key
from app.batches import service
from app.batches.ingest_run import cached_ingest_run, ingest_run_cache
from app.batches.schemas import JSON_CONTENT_TYPES, MSGPACK_CONTENT_TYPES, BatchOut
from app.config import Settings
from app.errors import Conflict, NotFound
from app.front import HotRoute
from app.key_cache import key_cache
from app.limits import InFlight
from app.runs.idempotency import is_idempotency_key

MAX_RUN_ID = 64
"""The route's declared limit (app/runs/deps.py); a longer id goes the documented way."""

_Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class LeanSubmitRoute(APIRoute):
    def get_route_handler(self) -> _Handler:
        documented = super().get_route_handler()

        async def handler(request: Request) -> Response:
            response = await fast_response(request, await request.body())
            return response if response is not None else await documented(request)

        return handler


async def fast_response(request: Request, body: bytes) -> Response | None:
    """The fast path's answer to a request of the route whose body is `body` (read and checked by
    the request guard), or None: the documented handler must answer. Raises what the route's
    handler would (the app's exception handlers answer it)."""
    lean = _fast_path_request(request)
    if lean is None:
        return None
    return await _submit(request, lean, body)


def hot_route(router: APIRouter) -> HotRoute:
    """The route of this class in `router` (the batches router), to be answered from the front
    layer (app/front.py) by `fast_response`."""
    (route,) = (r for r in router.routes if isinstance(r, LeanSubmitRoute))
    assert route.path == "/v1/runs/{run_id}/batches" and route.methods == {"POST"}, route.path
    return HotRoute(route, _HOT_PATH, fast_response)


_HOT_PATH = re.compile(r"^/v1/runs/(?P<run_id>[^/]+)/batches$")
"""The route's path (its `{run_id}` is a plain string parameter: any characters but "/")."""


class _Lean:
    __slots__ = ("idempotency_key", "msgpack", "run_id", "tenant_id")

    def __init__(self, tenant_id: str, run_id: str, msgpack: bool, idempotency_key: str | None) -> None:
        self.tenant_id = tenant_id
        self.run_id = run_id
        self.msgpack = msgpack
        self.idempotency_key = idempotency_key


def _fast_path_request(request: Request) -> _Lean | None:
    """What the fast path needs, or None when the documented handler must answer."""
    headers = request.headers
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    state = request.app.state
    settings: Settings = state.settings
    cached = key_cache(state, settings.api_key_cache_seconds).get(hash_key(token))
    if cached is None:
        return None
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type in MSGPACK_CONTENT_TYPES:
        msgpack = True
    elif media_type in JSON_CONTENT_TYPES or media_type.endswith("+json"):
        msgpack = False
    else:
        return None
    key = headers.get("idempotency-key")
    if key is not None and not is_idempotency_key(key):
        return None  # the documented route's 422 names the header
    run_id = request.path_params.get("run_id")
    if not isinstance(run_id, str) or len(run_id) > MAX_RUN_ID:
        return None
    return _Lean(cached.tenant_id, run_id, msgpack, key)


async def _submit(request: Request, lean: _Lean, body: bytes) -> Response:
    in_flight: InFlight = request.app.state.in_flight
    # 429 before anything else, as require_tenant does (before the documented route reads the body):
    # this limit bounds the threads a tenant holds, so it is answered before any work, the body's
    # check included, and it is brief (its requests end), so a client that retries gets the 422 soon.
    in_flight.acquire(lean.tenant_id)
    try:
        result = await run_in_threadpool(_submit_in_thread, request, lean, body)
    finally:
        in_flight.release(lean.tenant_id)
    out = BatchOut.model_validate(result.batch)
    return Response(
        out.__pydantic_serializer__.to_json(out),
        status_code=201 if result.created else 200,
        media_type="application/json",
    )


def _submit_in_thread(request: Request, lean: _Lean, body: bytes) -> service.SubmitResult:
    state = request.app.state
    settings: Settings = state.settings
    runs = ingest_run_cache(state, settings.ingest_run_cache_seconds)
    full = service.full_runs(state)
    with state.session_factory() as session:
        try:
            run = cached_ingest_run(session, runs, tenant_id=lean.tenant_id, run_id=lean.run_id)
            result = service.submit_batch(
                session,
                settings=settings,
                run=run,
                body=body,
                msgpack=lean.msgpack,
                idempotency_key=lean.idempotency_key,
                full=full,
            )
            session.commit()
            if not result.created:
                # A replay may answer for a run that has left since (service.submit_batch): read the
                # run again next time rather than write one more payload that its lock refuses.
                runs.pop((lean.tenant_id, lean.run_id))
        except (NotFound, Conflict) as refusal:
            session.rollback()
            if isinstance(refusal, NotFound) or refusal.code in service.RUN_MOVED:
                runs.pop((lean.tenant_id, lean.run_id))  # read it again next time (an early refusal)
            raise
        except BaseException:
            session.rollback()
            raise
    return result
