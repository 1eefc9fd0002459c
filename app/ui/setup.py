"""Wiring the dashboard into an app: routes, static files, the sign-in redirect, the count of failed
sign-ins (its security headers: app/front.py)."""

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse

from app.ui.login_limits import login_failures_for
from app.ui.router import SignInRequired, router, static_files


def install_ui(app: FastAPI) -> None:
    app.state.ui_login_failures = login_failures_for(app.state.settings)
    app.include_router(router)
    app.mount("/ui/static", static_files, name="ui-static")

    @app.exception_handler(SignInRequired)
    async def _sign_in(_: Request, __: SignInRequired) -> RedirectResponse:
        return RedirectResponse("/ui/login", status_code=303)
