"""Wiring the dashboard into an app: routes, static files, the sign-in redirect, the 429 of a busy
tenant, error pages for a browser's navigation (app/ui/error_pages.py), the count of failed sign-ins
(its security headers: app/front.py)."""

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from app.errors import error_body
from app.timestamps import as_utc
from app.ui import views
from app.ui.error_pages import install_error_pages
from app.ui.login_limits import login_failures_for
from app.ui.router import SignInRequired, TooBusy, render, router, static_files, templates


def install_ui(app: FastAPI) -> None:
    # The pages' <time> elements, in UTC: SQLite hands a stored time back naive, and a Postgres
    # session in another time zone would hand it back in that zone.
    templates.env.filters.update(utc=as_utc, iso_utc=views.iso_utc)
    app.state.ui_login_failures = login_failures_for(app.state.settings)
    app.include_router(router)
    app.mount("/ui/static", static_files, name="ui-static")
    install_error_pages(app)

    @app.exception_handler(SignInRequired)
    async def _sign_in(_: Request, __: SignInRequired) -> RedirectResponse:
        return RedirectResponse("/ui/login", status_code=303)

    @app.exception_handler(TooBusy)
    async def _too_busy(request: Request, exc: TooBusy) -> Response:
        refused = exc.refused
        headers = {"Retry-After": str(refused.retry_after)}
        # A browser's navigation (a page, a form post, a download link) gets a page saying so; the
        # page's EventSource and any script get the API's error body, which they can read.
        if "text/html" in request.headers.get("accept", ""):
            page = render(
                request,
                "busy.html",
                exc.viewer,
                limit=(refused.details or {}).get("limit"),
                retry_after=refused.retry_after,
                again=_same_page(request),
            )
            page.status_code = 429
            page.headers.update(headers)
            return page
        body = error_body(refused.code, refused.message, refused.details)
        return JSONResponse(body, status_code=429, headers=headers)


def _same_page(request: Request) -> str | None:
    """The page asked for (a route under /ui, so a path of this service), to ask for it again; None
    for a form post, which the browser would only repeat with the user's say-so."""
    if request.method != "GET":
        return None
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")
