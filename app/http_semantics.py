"""HTTP semantics the router leaves out: HEAD on every GET route, a 405's complete `Allow`, and
a 415 for a body of a type a route does not read (`require_json`; on /v1 by `JsonBodyRoute`).

FastAPI's routes answer exactly the methods they declare, so a HEAD (what link checkers, monitors
and resuming download clients send first) was a 405. `HeadAsGet` answers it as the GET, without the
body, for every GET route at once: no route of its own (a HEAD route per GET would also double the
OpenAPI document's operations).
"""

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from fastapi import params, routing
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import UnsupportedMediaType

_RANGE_HEADERS = (b"range", b"if-range")


class HeadAsGet:
    """A HEAD request goes through the app as a GET; its response leaves with the GET's status and
    headers (`Content-Length` included) and no body (RFC 9110 §9.3.2).

    The body is cut off at the response's start, and from then on the app's `receive` says the
    client is gone: a streamed response (an adapter download, an event stream) stops then, rather
    than being read through, whatever the server. (Starlette watches `receive` for the disconnect
    only under ASGI spec < 2.4, so the GET is passed on as 2.3: a 2.4 server's sends never fail here,
    the body being dropped, and a HEAD of an event stream would hold its place for an hour.) `Range` and
    `If-Range` are dropped: range requests are defined for GET only (RFC 9110 §14.2), so a HEAD tells
    a resuming client the whole file's length and `Accept-Ranges`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        # A copy: the server's own scope keeps saying HEAD (uvicorn reads it to expect no body).
        headers = [(name, value) for name, value in scope["headers"] if name not in _RANGE_HEADERS]
        asgi = {**scope.get("asgi", {}), "spec_version": "2.3"}
        as_get = {**scope, "method": "GET", "headers": headers, "asgi": asgi}
        answered = asyncio.Event()

        async def without_body(message: Message) -> None:
            if answered.is_set():
                return  # the body, and anything after it
            if message["type"] == "http.response.start":
                answered.set()
                await send(message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def gone_once_answered() -> Message:
            if answered.is_set():
                return {"type": "http.disconnect"}
            message = asyncio.ensure_future(receive())
            answer = asyncio.ensure_future(answered.wait())
            done, _ = await asyncio.wait((message, answer), return_when=asyncio.FIRST_COMPLETED)
            if message in done:
                answer.cancel()
                return message.result()
            message.cancel()
            return {"type": "http.disconnect"}

        await self.app(as_get, gone_once_answered, without_body)


def allowed_methods(routes: Iterable[BaseRoute], scope: Scope) -> str | None:
    """The `Allow` header of a 405 for the request's path: the methods of every route of that path
    (Starlette's own names only the first route that matched), HEAD wherever GET is (HeadAsGet);
    None when no route declares methods for it."""
    methods: set[str] = set()
    # FastAPI >= 0.130 nests included routers; their routes, as the router matches them, come flat
    # from iter_route_contexts (as in app/openapi.py).
    contexts = getattr(routing, "iter_route_contexts", None)
    for route in contexts(routes) if contexts is not None else routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(scope)[0] != Match.NONE:
            methods.update(route_methods)
    if "GET" in methods:
        methods.add("HEAD")
    return ", ".join(sorted(methods)) or None


JSON_MEDIA_TYPE = "application/json"
SHOWN_MEDIA_TYPE_CHARS = 100


def media_type(content_type: str | None) -> str:
    """The media type of a `Content-Type` value, lowercased and without its parameters; "" for none."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def is_json(media: str) -> bool:
    """Whether `media` (from `media_type`) declares JSON: application/json or a `+json` type, the
    types FastAPI parses as JSON."""
    return media == JSON_MEDIA_TYPE or (media.startswith("application/") and media.endswith("+json"))


def require_json(content_type: str | None, *, has_body: bool) -> None:
    """The 415 of a route FastAPI reads a JSON body for, sent a body it would not read as JSON,
    naming the type it takes. FastAPI validates such a body as bytes: a 422 saying the body is not
    an object, which sends a client looking for a wrong field rather than at its Content-Type. That
    includes a body without a Content-Type (FastAPI's `strict_content_type`: a browser may post one
    cross-site without asking first); no body at all is left to the route (a missing field, or none)."""
    media = media_type(content_type)
    if is_json(media) or (media == "" and not has_body):
        return
    shown = media[:SHOWN_MEDIA_TYPE_CHARS]  # a header can be 8 KB long
    said = f"unsupported Content-Type {shown!r}" if shown else "a body without a Content-Type"
    raise UnsupportedMediaType(
        f"{said}; send {JSON_MEDIA_TYPE}",
        details={"content_type": shown or None, "accepted": [JSON_MEDIA_TYPE]},
    )


def reads_json_body(route: Any) -> bool:
    """Whether FastAPI reads `route`'s body as JSON: it declares a body (a pydantic model, a dict),
    and not a form. A route that reads its own body (`Request.body()`) declares none."""
    body = getattr(route, "body_field", None)
    return body is not None and not isinstance(body.field_info, params.Form)


class JsonBodyRoute(routing.APIRoute):
    """The route class of the /v1 routers: a route with a typed JSON body answers a body sent as
    another type, or without a Content-Type, with `require_json`'s 415 instead of FastAPI's 422 (the
    body validated as bytes: "Input should be a valid dictionary", which sends a client looking for
    a wrong field rather than at its Content-Type).

    The 415 replaces the 422 the route would have answered, and nothing else: the caller's 401, 403
    and 404 (its dependencies) come first, as on the Tinker API, and a request that worked before
    still does (JSON of any spelling FastAPI reads; no body on a route whose body is optional). A
    route whose body FastAPI does not read (none, a form, one it reads itself) is left as it is.
    The OpenAPI document lists the 415 of these routes (app/openapi.py)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        # Called for the route and for each inclusion of its router (FastAPI >= 0.130): each
        # handler is wrapped, the body field being the endpoint's own.
        handler = super().get_route_handler()
        if not reads_json_body(self):
            return handler

        async def json_only(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError:
                # FastAPI read the body (it is cached on the request) and found it invalid: a body it
                # did not read as JSON is why, whatever else is wrong.
                require_json(request.headers.get("content-type"), has_body=bool(await request.body()))
                raise

        return json_only
