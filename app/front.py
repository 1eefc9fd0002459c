"""The service's one per-request ASGI layer, and the hot route taken through it.

One pure-ASGI class does, in this order, what four middlewares did one inside the other (each a
coroutine frame and a `send` wrapper per request, and each response message passed down all of them):

1. request metrics: every request counted and timed by route template and status, refusals of the
   guards below and error responses included (app/telemetry/http.py);
2. the error guard: an X-Request-ID on every response, and no exception leaves as a text/plain 500
   (app/error_guard.py);
3. the request guard: head size (431), NUL in the path or query (422), declared and actual body
   size (413), on the bulk routes (the pool's, the Tinker API's, the tenants') the caller's
   credential before the body is read (401/403), the process's budget of bodies being read (503;
   a tenant past its share of it: 429), path and query not UTF-8 once percent-decoded (422),
   the body's read deadline (408), JSON bodies' UTF-8, depth and NUL checks (422), all before any
   route, and so before any database session but the credential check's lookup
   (app/request_guard.py);
4. the dashboard's security headers on the responses of its pages (app/ui/security.py).

The layer sits where those four sat: inside FastAPI's own (server error, telemetry, body limit),
outside its exception handlers and router. Refusals and error responses are sent as before, with
the request id but without the dashboard headers (they were outside that middleware).

The hot route, `POST /v1/runs/{run_id}/batches`, once its body is read and checked here, is handed
to its fast path (app/batches/lean_route.py) without the exception-handler, exit-stack and routing
layers: the fast path's errors go through the app's exception handlers as the route's would, and
`scope["route"]` is set to the same route object the router sets (the metrics' label). Whatever the
fast path cannot vouch for goes on through the whole stack, as before. FastAPI's native telemetry,
when enabled, records the matched route in the router: such requests always take the whole stack.
"""

import inspect
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.error_guard import REQUEST_ID_HEADER, error_response
from app.request_guard import CLIENT_GONE, BodyGuard
from app.telemetry.http import UNMATCHED, HttpMetrics
from app.ui.security import HEADERS as DASHBOARD_HEADERS

_REQUEST_ID_NAME = REQUEST_ID_HEADER.lower().encode()

CLIENT_CLOSED_REQUEST = 499
"""The status recorded (never sent) for a request whose client left before its body's end."""

FastHandler = Callable[[Request, bytes], Awaitable[Response | None]]
"""A route's fast path: its response, or None when the request must take the whole stack."""


class HotRoute:
    """A POST route handled straight from the front layer. `route` is the router's own route
    object (what the router would put in `scope["route"]`); `fast` its fast path."""

    def __init__(self, route: BaseRoute, path_regex: "re.Pattern[str]", fast: FastHandler) -> None:
        self.route = route
        self.path_regex = path_regex
        self.fast = fast

    def path_params(self, scope: Scope) -> dict[str, str] | None:
        if scope["method"] != "POST" or scope.get("root_path") or "fastapi.telemetry" in scope:
            return None
        match = self.path_regex.match(scope["path"])
        return None if match is None else match.groupdict()


class Front:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: HttpMetrics,
        max_body_bytes: int,
        max_small_body_bytes: int,
        body_timeout_seconds: float,
        hot: HotRoute | None = None,
        dashboard_prefix: str = "/ui",
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.guard = BodyGuard(
            max_body_bytes=max_body_bytes,
            max_small_body_bytes=max_small_body_bytes,
            body_timeout_seconds=body_timeout_seconds,
        )
        self.hot = hot
        self.dashboard_prefix = dashboard_prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.perf_counter()
        request_id = uuid.uuid4().hex
        id_header = (_REQUEST_ID_NAME, request_id.encode())
        status = 500
        started = False

        async def send_out(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), id_header]}
            await send(message)

        path: str = scope.get("path", "")
        prefix = self.dashboard_prefix
        send_app = send_out
        if path == prefix or path.startswith(prefix + "/"):

            async def send_app(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = list(message.get("headers", [])) + DASHBOARD_HEADERS
                await send_out(message)

        try:
            await self._guarded(scope, receive, send_out, send_app)
        except Exception as exc:
            if started:  # too late for an error body; let the server close the connection
                raise
            await error_response(exc, scope, request_id)(scope, receive, send_out)
        finally:
            if not started and scope.get(CLIENT_GONE):
                status = CLIENT_CLOSED_REQUEST
            route: BaseRoute | None = scope.get("route")  # set by the router (or the hot route) once matched
            template = getattr(route, "path", None) or UNMATCHED
            method = scope.get("method", "GET")
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - started_at)

    async def _guarded(self, scope: Scope, receive: Receive, send_out: Send, send_app: Send) -> None:
        checked = await self.guard.check(scope, receive, send_out)
        if checked is None:  # refused (and answered)
            return
        body, replay = checked
        hot = self.hot
        if hot is not None and (params := hot.path_params(scope)) is not None:
            scope["route"] = hot.route
            scope["endpoint"] = getattr(hot.route, "endpoint", None)
            scope["path_params"] = params
            request = Request(scope, replay)
            try:
                response = await hot.fast(request, body)
            except Exception as exc:
                handled = await _handled(request, exc)
                if handled is None:
                    raise
                response = handled
            if response is not None:
                await response(scope, replay, send_app)
                return
            for key in ("route", "endpoint", "path_params"):  # the router sets them its own way
                del scope[key]
        await self.app(scope, replay, send_app)


async def _handled(request: Request, exc: Exception) -> Response | None:
    """The app's exception handler's response to `exc` (as its exception middleware would look it
    up: an HTTPException's status code first, then the exception's classes, most specific first), or
    None: the error guard answers."""
    handlers: dict[Any, Any] = request.app.exception_handlers
    keys: list[Any] = [exc.status_code] if isinstance(exc, HTTPException) else []
    for cls in [*keys, *type(exc).__mro__]:
        if cls is Exception:  # the server-error handler's key, not the exception middleware's
            return None
        handler = handlers.get(cls)
        if handler is not None:
            if inspect.iscoroutinefunction(handler):
                response: Response = await handler(request, exc)
            else:
                response = await run_in_threadpool(handler, request, exc)
            return response
    return None
