"""The dashboard's errors as pages: a browser that navigates to a page under /ui (a link, a form post,
a download) and is refused (a 403 admin view, a 404 run, a form field too long, a path the dashboard
does not have) gets an HTML page in the dashboard's frame saying so, not the API's JSON error body.

Anything else keeps that body: the run page's EventSource (Accept: text/event-stream) and its
scripts' requests (Accept: application/json) read it, as does every API route. A browser's
navigation is told apart by its Accept header, as the 429 of a busy tenant is (app/ui/setup.py).

The app's own handlers (app/main.py) answer everything that is not a page; these wrap them, so they
must be installed after them (create_app calls `install_ui` once its handlers are in place)."""

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from app.errors import AppError, RateLimited
from app.http_semantics import allowed_methods
from app.ui.router import render

Handler = Callable[[Request, Any], Response | Awaitable[Response]]

TITLES = {
    400: "Bad request",
    401: "Not signed in",
    403: "Not allowed",
    404: "Not found",
    405: "Not allowed",
    409: "Not possible now",
    413: "Too large",
    422: "Invalid request",
    429: "Too many requests",
}
PREFIX = "/ui"


def is_page_request(request: Request) -> bool:
    """A browser's navigation to a dashboard path (its static files included)."""
    path = request.url.path
    under_ui = path == PREFIX or path.startswith(PREFIX + "/")
    return under_ui and "text/html" in request.headers.get("accept", "")


def _problems(exc: RequestValidationError) -> list[str]:
    """Each invalid field and why, never the value sent (a sign-in key too long to be one is still a
    secret)."""
    out = []
    for error in exc.errors():
        loc = [str(part) for part in error.get("loc", ()) if part not in ("body", "query", "path", "header")]
        out.append(f"{'.'.join(loc) or 'request'}: {error.get('msg', 'invalid')}")
    return out


def error_page(request: Request, exc: Exception) -> Response:
    """The page for an error the API would answer with its JSON body."""
    headers: dict[str, str] = {}
    problems: list[str] = []
    if isinstance(exc, AppError):
        status, message = exc.status, exc.message
        # What the API's handler sends with it (Retry-After of a 429, ...), where the error has any.
        headers.update(getattr(exc, "headers", None) or {})
        if isinstance(exc, RateLimited):
            headers["Retry-After"] = str(exc.retry_after)
    elif isinstance(exc, RequestValidationError):
        status, message, problems = 422, "Nothing was done: the request was not valid.", _problems(exc)
    elif isinstance(exc, StarletteHTTPException):
        status, message = exc.status_code, str(exc.detail)
        headers.update(exc.headers or {})
        if status == 405 and (allow := allowed_methods(request.app.router.routes, request.scope)):
            headers["Allow"] = allow  # as the API's 405 (app/main.py): every method the path takes
    else:  # pragma: no cover - only the classes above are wrapped
        raise exc
    signed_out = status == 401 or request.url.path == PREFIX + "/login"
    page = render(
        request,
        "error.html",
        None,
        status=status,
        title=TITLES.get(status, "Error"),
        message=message,
        problems=problems,
        back=PREFIX + "/login" if signed_out else PREFIX,
        back_label="Sign in" if signed_out else "Back to the dashboard",
    )
    page.status_code = status
    page.headers.update(headers)
    return page


def _page_or(previous: Handler) -> Handler:
    async def handler(request: Request, exc: Exception) -> Response:
        if is_page_request(request):
            return error_page(request, exc)
        if inspect.iscoroutinefunction(previous):
            response: Response = await previous(request, exc)
            return response
        return await run_in_threadpool(previous, request, exc)  # type: ignore[arg-type]

    return handler


def install_error_pages(app: FastAPI) -> None:
    """Wrap the app's handlers of the errors a page can meet: pages for the dashboard's navigation,
    the handler as it was for everything else."""
    for cls in (AppError, RequestValidationError, StarletteHTTPException):
        previous = app.exception_handlers.get(cls)
        if previous is None:  # not `assert`: python -O would drop it, and every API error with it
            raise RuntimeError(f"install_ui must come after the app's handler of {cls.__name__}")
        app.add_exception_handler(cls, _page_or(previous))
