"""create_app(): settings, database, lifespan, routers, and the one error format."""

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.adapters.pool_router import router as pool_adapters_router
from app.adapters.router import router as adapters_router
from app.batches.pool_router import router as pool_batches_router
from app.batches.router import router as batches_router
from app.config import Settings, get_settings
from app.db import make_engine, make_session_factory
from app.errors import AppError
from app.lifecycle import on_shutdown, on_startup
from app.pools.router import router as pools_router
from app.runs.router import router as runs_router
from app.tenants.router import router as tenants_router
from app.tinker.pool_router import router as pool_tinker_router
from app.tinker.router import router as tinker_router

log = logging.getLogger("loraloom")


def error_body(code: str, message: str, details: Any = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details}}


class BodySizeLimit:
    """Refuse request bodies above max_body_bytes with a 413, whether or not Content-Length is sent."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received = 0
        too_large = False

        async def limited_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_large = True
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        response = JSONResponse(
            error_body("payload_too_large", f"request body exceeds {self.max_bytes} bytes"), status_code=413
        )
        await response({"type": "http"}, _empty_receive, send)


class _BodyTooLarge(Exception):
    pass


async def _empty_receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(AppError)
    async def _app_error(_: Request, exc: AppError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, exc.message, exc.details), status_code=exc.status)

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
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
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
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = make_session_factory(engine)
    _install_error_handlers(app)

    @app.get("/healthz", tags=["health"], operation_id="healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], operation_id="readyz")
    def readyz() -> JSONResponse:
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # the database is down or unreachable
            log.warning("readiness check failed: %s", type(exc).__name__)
            return JSONResponse(error_body("database_unavailable", "database unreachable"), status_code=503)
        return JSONResponse({"status": "ready"})

    for router in (
        tenants_router,
        runs_router,
        batches_router,
        pool_batches_router,
        adapters_router,
        pool_adapters_router,
        pools_router,
        tinker_router,
        pool_tinker_router,
    ):
        app.include_router(router)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app
