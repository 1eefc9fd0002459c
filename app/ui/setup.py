"""Wiring the dashboard into an app: routes, static files, headers, the sign-in redirect."""

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse

from app.ui.router import SignInRequired, router, static_files
from app.ui.security import DashboardHeaders


def install_ui(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/static", static_files, name="ui-static")
    app.add_middleware(DashboardHeaders)

    @app.exception_handler(SignInRequired)
    async def _sign_in(_: Request, __: SignInRequired) -> RedirectResponse:
        return RedirectResponse("/ui/login", status_code=303)
