"""create_app(): settings, database, lifespan, routers, and the one error format."""

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import cookie_unquote
from app.adapters.pool_router import router as pool_adapters_router
from app.adapters.router import router as adapters_router
from app.adapters.tenant_router import router as tenant_adapters_router
from app.batches.lean_route import hot_route
from app.batches.pool_router import router as pool_batches_router
from app.batches.router import router as batches_router
from app.config import Settings, get_settings
from app.db import make_engine, make_session_factory
from app.errors import AppError, error_body
from app.events.router import router as events_router
from app.front import Front
from app.http_semantics import HeadAsGet, allowed_methods
from app.lifecycle import on_shutdown, on_startup
from app.limits import EVENT_STREAMS_RETRY_AFTER_SECONDS, InFlight
from app.migrate import head_revision, schema_revision
from app.openapi import install_openapi
from app.pools.admin_router import router as pools_admin_router
from app.pools.catalog import router as pools_catalog_router
from app.pools.router import router as pools_router
from app.runs.router import router as runs_router
from app.shutdown import ShutdownNotice
from app.telemetry.setup import install_metrics
from app.tenants.router import router as tenants_router
from app.tinker.pool_router import router as pool_tinker_router
from app.tinker.router import router as tinker_router
from app.ui.setup import install_ui

log = logging.getLogger("loraloom")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready"]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AppError)
    async def _app_error(_: Request, exc: AppError) -> JSONResponse:
        # Retry-After of a 429, WWW-Authenticate of a Bearer route's 401 (app/errors.py)
        return JSONResponse(
            error_body(exc.code, exc.message, exc.details), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            {
                "loc": [str(p) for p in err.get("loc", ())],
                "msg": err.get("msg", ""),
                "type": err.get("type", ""),
            }
            for err in exc.errors()
        ]
        return JSONResponse(
            error_body("validation_error", f"{len(problems)} invalid field(s)", problems), status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        headers = dict(exc.headers or {})
        if exc.status_code == 405 and (allow := allowed_methods(request.app.router.routes, request.scope)):
            headers["Allow"] = allow  # RFC 9110 §15.5.6; Starlette's names only the first matching route's
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=headers)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    cookie_unquote.install()  # every request's Cookie header is parsed: linear, on every Python
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await on_startup(app)
        try:
            yield
        finally:
            await on_shutdown(app)
            engine.dispose()

    app = FastAPI(
        title="loraloom",
        version="0.1.0",
        summary="Multi-tenant RL training service for LoRA adapters.",
        lifespan=lifespan,
        # A path with a stray trailing slash is a 404 like any unknown path: the router's redirect
        # was built from the client's Host header (an absolute Location anyone could point elsewhere)
        # and had an empty body; no client of this API (the SDK, the Tinker SDK, the dashboard's
        # links) asks for one.
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    app.state.shutdown = ShutdownNotice()  # begun by the server's shutdown (app/serving.py)
    app.state.in_flight = InFlight(settings.tenant_max_in_flight)
    app.state.event_streams = InFlight(
        settings.tenant_max_event_streams, kind="event_streams", retry_after=EVENT_STREAMS_RETRY_AFTER_SECONDS
    )
    _install_error_handlers(app)

    @app.get("/healthz", tags=["health"], operation_id="healthz")
    def healthz() -> Health:
        return Health(status="ok")

    head = head_revision()

    @app.get(
        "/readyz",
        tags=["health"],
        operation_id="readyz",
        response_model=Readiness,
        responses={
            503: {
                "description": "database_unavailable: the database does not answer; schema_not_current: the schema is not at the migration head."
            }
        },
    )
    def readyz() -> JSONResponse:
        """Ready: the database answers and its schema is at the migration head this code expects."""
        try:
            with engine.connect() as conn:
                current = schema_revision(conn)
        except Exception as exc:  # the database is down or unreachable
            log.warning("readiness check failed: %s", type(exc).__name__)
            return JSONResponse(
                error_body("database_unavailable", "database unreachable"),
                status_code=503,
                headers={"Retry-After": "5"},
            )
        if current != head:
            return JSONResponse(
                error_body(
                    "schema_not_current",
                    f"database schema is at {current or 'no revision'}, this service needs {head}; "
                    "run `loraloom db upgrade`",
                    {"current": current, "head": head},
                ),
                status_code=503,
            )
        return JSONResponse({"status": "ready"})

    for router in (
        tenants_router,
        runs_router,
        batches_router,
        pool_batches_router,
        adapters_router,
        pool_adapters_router,
        pools_router,
        events_router,
        pools_admin_router,
        pools_catalog_router,
        tenant_adapters_router,
        tinker_router,
        pool_tinker_router,
    ):
        app.include_router(router)
    install_ui(app)
    metrics = install_metrics(app)
    # One layer for the request metrics, the error guard, the request guard (the body is read and
    # checked before anything opens a database session) and the dashboard's headers; the hot
    # ingestion route is answered from it (app/front.py).
    app.add_middleware(
        Front,
        metrics=metrics,
        max_body_bytes=settings.max_body_bytes,
        max_small_body_bytes=settings.max_small_body_bytes,
        body_timeout_seconds=settings.body_timeout_seconds,
        hot=hot_route(batches_router),
    )
    app.add_middleware(HeadAsGet)  # outside Front: the guards, metrics and routes see the GET
    install_openapi(app)
    return app
