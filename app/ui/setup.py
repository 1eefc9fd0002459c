"""Wiring the dashboard into an app: routes, static files, the sign-in redirect (its security
headers: app/front.py)."""

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse

from app.ui.router import SignInRequired, router, static_files


def install_ui(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/static", static_files, name="ui-static")

    @app.exception_handler(SignInRequired)
    async def _sign_in(_: Request, __: SignInRequired) -> RedirectResponse:
        return RedirectResponse("/ui/login", status_code=303)
