"""The dashboard's pages and form posts (/ui). Thin, like the API routers: resolve the viewer,
call the services, render a template.

Authentication: the session cookie (HttpOnly, SameSite=Strict, Secure over HTTPS) names a
server-side session; every POST also carries the session's CSRF token. Another tenant's run is a
404, exactly as on the API. Failed sign-ins are bounded per client address (app/ui/login_limits.py).

A signed-in tenant's pages and form posts count against the tenant's `tenant_max_in_flight`, the
same places its API requests take (app/limits.py): a page costs the service what an API call does
(/ui/runs reads and validates a hundred runs' configs), so a tenant's dashboard flood gets 429s
instead of the other tenants' threads and connections. The admin's are not counted, as the API's
admin routes are not: there is one admin key, its holder can do anything the limit protects
against, and counting it under a tenant's place would let that tenant's flood lock the operator out
of the view needed to deal with it.
"""

import json
import math
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from app.adapters import service as adapters
from app.adapters.file_response import OpenFileResponse
from app.adapters.router import StepPath
from app.auth import SettingsDep, in_flight_place
from app.db import SessionDep
from app.errors import Forbidden, NotFound, RateLimited, Unauthorized
from app.events.router import LastEventId, event_stream, start_of
from app.runs import service as runs
from app.runs.deps import refuse_if_run_deleted
from app.runs.models import Run
from app.runs.schemas import REASON_CHARS
from app.serving import proxy_headers_configured
from app.ui import sessions, views
from app.ui.login_limits import LoginFailures, client_address
from app.ui.sessions import COOKIE, Viewer, still_signed_in
from contracts.status import RunStatus

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
KEY_MAX_CHARS = 512
"""The longest key the sign-in form takes (the page's input says so too, so a browser stops there)."""
templates.env.globals["key_max_chars"] = KEY_MAX_CHARS
static_files = StaticFiles(directory=HERE / "static")

router = APIRouter(prefix="/ui", include_in_schema=False)


class SignInRequired(Exception):
    """A page asked for without a valid session: answered with a redirect to the sign-in page."""


class TooBusy(Exception):
    """The viewer's tenant has `tenant_max_in_flight` requests in flight already: a 429 with
    Retry-After, as a page for a browser's navigation and as the API's error body otherwise (the
    page's EventSource, scripts), app/ui/setup.py."""

    def __init__(self, refused: RateLimited, viewer: Viewer) -> None:
        super().__init__(refused.message)
        self.refused = refused
        self.viewer = viewer


def optional_viewer(request: Request, session: SessionDep) -> Viewer | None:
    return sessions.resolve(session, secret=request.cookies.get(COOKIE))


def _counted(request: Request, viewer: Viewer) -> Iterator[Viewer]:
    """The viewer, holding one of its tenant's in-flight places until the handler has returned
    (scope="function", as the API's TenantDep: a page is rendered inside its handler, while a live
    event stream, which outlives its handler by up to an hour, holds an event-stream place instead,
    so a tenant's open streams never keep its pages from loading)."""
    if viewer.tenant_id is None:  # the admin: not counted (the module's docstring says why)
        yield viewer
        return
    with ExitStack() as held:
        try:
            held.enter_context(in_flight_place(request, viewer.tenant_id))
        except RateLimited as refused:
            raise TooBusy(refused, viewer) from refused
        yield viewer


def page_viewer(
    request: Request, viewer: Annotated[Viewer | None, Depends(optional_viewer)]
) -> Iterator[Viewer]:
    if viewer is None:
        raise SignInRequired
    yield from _counted(request, viewer)


def post_viewer(
    request: Request,
    viewer: Annotated[Viewer | None, Depends(optional_viewer)],
    csrf: Annotated[str, Form()] = "",
) -> Iterator[Viewer]:
    """A form post: a valid session and its CSRF token, or nothing happens."""
    if viewer is None:
        raise Unauthorized("not signed in")
    if not sessions.csrf_ok(viewer, csrf):
        raise Forbidden("missing or wrong CSRF token", code="csrf_failed")
    yield from _counted(request, viewer)


ViewerDep = Annotated[Viewer, Depends(page_viewer, scope="function")]
PostViewerDep = Annotated[Viewer, Depends(post_viewer, scope="function")]


def tenant_of(viewer: Viewer) -> str:
    if viewer.tenant_id is None:  # an admin session has no runs of its own
        raise NotFound("sign in with a tenant key to see runs")
    return viewer.tenant_id


def owned_run(run_id: str, viewer: ViewerDep, session: SessionDep) -> Run:
    return runs.get_run_for_tenant(session, tenant_id=tenant_of(viewer), run_id=run_id)


OwnedRun = Annotated[Run, Depends(owned_run)]


def render(request: Request, template: str, viewer: Viewer | None, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, template, {"viewer": viewer, **context})


# ----------------------------------------------------------------------------- signing in and out


@router.get("/login")
def login_page(request: Request, viewer: Annotated[Viewer | None, Depends(optional_viewer)]) -> Response:
    if viewer is not None:
        return RedirectResponse("/ui/admin" if viewer.is_admin else "/ui/runs", status_code=303)
    return render(request, "login.html", None, error=None)


def _cross_site(request: Request) -> bool:
    """Whether the request's Origin (when the browser sent one) is another site than this service: its
    host is neither the Host header nor, behind a proxy that rewrites Host, X-Forwarded-Host. That one
    is read only when the deployment names its proxies (`FORWARDED_ALLOW_IPS`), as the X-Forwarded-For
    and -Proto headers are: without a proxy any client could name the Origin's host in it."""
    origin = request.headers.get("origin")
    if origin is None:
        return False
    hosts = {request.headers.get("host", "")}
    if proxy_headers_configured():
        hosts.update(request.headers.get("x-forwarded-host", "").split(","))
    return origin.split("://", 1)[-1].rstrip("/").lower() not in {h.strip().lower() for h in hosts if h}


def login_failures(request: Request) -> LoginFailures:
    failures: LoginFailures = request.app.state.ui_login_failures
    return failures


def _too_many_failures(request: Request, retry_after: int) -> Response:
    """The sign-in page again, saying why nothing was checked and when to try again."""
    minutes = math.ceil(retry_after / 60)
    when = f"{retry_after} seconds" if retry_after < 120 else f"{minutes} minutes"
    error = f"Too many failed sign-ins from your address. Try again in {when}."
    refused = render(request, "login.html", None, error=error)
    refused.status_code = 429
    refused.headers["Retry-After"] = str(retry_after)
    return refused


@router.post("/login")
def login(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    failures: Annotated[LoginFailures, Depends(login_failures)],
    key: Annotated[str, Form(max_length=KEY_MAX_CHARS)] = "",
) -> Response:
    if _cross_site(request):
        # Login CSRF: another site's form could sign a visitor in as the attacker's tenant (there is
        # no session, so no CSRF token, yet). Browsers send Origin with every cross-site POST.
        raise Forbidden("sign in from this service's own login page", code="csrf_failed")
    address = client_address(request)
    # Refused before the key is looked at: a right guess past the bound must not be told apart.
    attempt = failures.admit(address)
    if attempt is None:
        return _too_many_failures(request, failures.retry_after(address) or 1)
    try:
        secret = sessions.sign_in(session, key=key, settings=settings)
    except Unauthorized:  # counted as a failure by `admit` already
        refused = render(request, "login.html", None, error="That key is not valid (or was revoked).")
        refused.status_code = 401
        return refused
    failures.succeeded(address, attempt)
    viewer = sessions.resolve(session, secret=secret)
    target = "/ui/admin" if viewer is not None and viewer.is_admin else "/ui/runs"
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        COOKIE,
        secret,
        max_age=int(sessions.SESSION_LIFETIME.total_seconds()),
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
def logout(request: Request, viewer: PostViewerDep, session: SessionDep) -> Response:
    sessions.sign_out(session, viewer=viewer)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(
        COOKIE, path="/ui", httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )
    return response


@router.get("")
@router.get("/")  # the app has no slash redirects (app/main.py): the dashboard's root takes both
def home(viewer: ViewerDep) -> Response:
    return RedirectResponse("/ui/admin" if viewer.is_admin else "/ui/runs", status_code=303)


# ----------------------------------------------------------------------------- runs


@router.get("/runs")
def runs_page(
    request: Request,
    viewer: ViewerDep,
    session: SessionDep,
    status: Annotated[RunStatus | None, Query()] = None,
    name: Annotated[str | None, Query(max_length=128)] = None,
) -> Response:
    if viewer.is_admin:
        return RedirectResponse("/ui/admin", status_code=303)
    rows = views.runs_of(session, tenant_id=tenant_of(viewer), status=status, name=name or None)
    return render(
        request, "runs.html", viewer, rows=rows, status=status, name=name or "", statuses=list(RunStatus)
    )


RUN_PAGE_ADAPTERS = 50


@router.get("/runs/{run_id}")
def run_page(request: Request, viewer: ViewerDep, run: OwnedRun, session: SessionDep) -> Response:
    data = views.run_page_data(session, run=run)
    events = data.pop("events")
    # The newest few, as the page's one query: a run that keeps every step (LORALOOM_RUN_ADAPTERS_KEPT=0)
    # may hold thousands; the page says where the older ones are listed.
    shown, older = adapters.adapters_page(
        session, run_id=run.id, limit=RUN_PAGE_ADAPTERS, after_step=None, newest_first=True
    )
    deleted = run.status == RunStatus.DELETED
    if deleted:  # their files went with the run, as the API's list says (and its metrics: views.py)
        shown, older = [], None
    return render(
        request,
        "run.html",
        viewer,
        run=run,
        data=data,
        events=events,
        config=json.dumps(run.config, indent=2, sort_keys=True),
        adapters=shown,
        older_adapters=older is not None,
        movable=run.status in (RunStatus.QUEUED, RunStatus.ACTIVE),
        deleted=deleted,
    )


@router.get("/runs/{run_id}/events")
def run_events(
    request: Request,
    viewer: ViewerDep,
    run: OwnedRun,
    session: SessionDep,
    cursor: Annotated[str | None, Query(max_length=128)] = None,
    last_event_id: LastEventId = None,
) -> Response:
    """The run's live event stream for the page's EventSource (cookie-authenticated); a bad cursor
    or Last-Event-ID is a 422 before the stream starts, as on the API (app/events/router.py start_of),
    and it ends after the run's deletion, as there (a 204 once past it)."""
    after = start_of(cursor, last_event_id)
    allowed = still_signed_in(viewer.session_id)
    return event_stream(
        request, session, run_id=run.id, tenant_id=run.tenant_id, after=after, since=None, allowed=allowed
    )


@router.get("/runs/{run_id}/adapters/{step}")
def download_adapter(
    run: OwnedRun, step: StepPath, session: SessionDep, settings: SettingsDep
) -> OpenFileResponse:
    """A step, or `latest` for the newest, as the API's download takes them (app/adapters/router.py)."""
    # StepPath's pattern leaves "latest" or up to 9 ASCII digits.
    refuse_if_run_deleted(run, what="adapters")
    adapter = adapters.get_adapter(
        session,
        run_id=run.id,
        step=None if step == "latest" else int(step),
        kept=settings.run_adapters_kept,
    )
    session.commit()  # the read ends: the archive may be built now (seconds; SQLite's write lock)
    # From a file opened before the headers go out: a run deleted meanwhile still sends it whole.
    return OpenFileResponse(
        adapters.open_adapter_archive(adapter, settings=settings),
        media_type="application/gzip",
        filename=f"{run.id}_step_{adapter.step}.tar.gz",
    )


@router.post("/runs/{run_id}/evict")
def evict(
    run_id: str,
    viewer: PostViewerDep,
    session: SessionDep,
    settings: SettingsDep,
    reason: Annotated[str, Form(max_length=4096, pattern=f"^{REASON_CHARS}*$")] = "",
    confirm: Annotated[str, Form()] = "",
) -> Response:
    run = runs.get_run_for_tenant(session, tenant_id=tenant_of(viewer), run_id=run_id)
    if confirm != "yes":
        raise Forbidden("eviction not confirmed", code="not_confirmed")
    runs.evict_run(
        session,
        run=run,
        reason=reason.strip() or "evicted from the dashboard",
        evicted_by="user",
        actor="tenant",
        settings=settings,
    )
    return RedirectResponse(f"/ui/runs/{run.id}", status_code=303)


# ----------------------------------------------------------------------------- pools and admin


@router.get("/pools")
def pools_page(request: Request, viewer: ViewerDep, session: SessionDep) -> Response:
    return render(request, "pools.html", viewer, pools=views.pools(session))


@router.get("/admin")
def admin_page(request: Request, viewer: ViewerDep, session: SessionDep) -> Response:
    if not viewer.is_admin:
        raise Forbidden("the admin view needs the admin key")
    return render(
        request,
        "admin.html",
        viewer,
        tenants=views.tenants(session),
        pools=views.pools(session, live_only=False),
    )
