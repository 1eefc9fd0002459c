"""The dashboard without a browser: sessions and their cookie, CSRF, the tenant-isolation table
over every /ui/runs/{run_id} route, the admin view, and the security headers."""

import re

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.ui.router import router as ui_router
from app.ui.security import CSP
from app.ui.sessions import COOKIE
from tests.app.api import TenantHandle, create_run, new_tenant
from tests.common import ADMIN_KEY


def sign_in(client: TestClient, key: str) -> str:
    """Sign in; returns the CSRF token of the new session (the cookie stays in the client's jar)."""
    r = client.post("/ui/login", data={"key": key}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = client.get(r.headers["location"])
    assert page.status_code == 200
    token = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert token is not None
    return token.group(1)


def test_sign_in_cookie_and_sign_out(app: FastAPI, tenant: TenantHandle) -> None:
    with TestClient(app) as client:
        assert client.get("/ui/runs", follow_redirects=False).headers["location"] == "/ui/login"
        r = client.post("/ui/login", data={"key": "llk_wrong"}, follow_redirects=False)
        assert r.status_code == 401 and "not valid" in r.text and COOKIE not in r.cookies

        r = client.post("/ui/login", data={"key": tenant.key}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/runs"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
        assert "Secure" not in cookie  # plain HTTP: a Secure cookie would never come back
        assert tenant.key not in cookie
        secret = client.cookies[COOKIE]
        page = client.get("/ui/runs")
        assert page.status_code == 200 and tenant.key not in page.text
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)  # type: ignore[union-attr]

        # Signing out without the CSRF token does nothing; with it, the session is gone for good.
        assert client.post("/ui/logout", data={}).status_code == 403
        assert client.get("/ui/runs").status_code == 200
        r = client.post("/ui/logout", data={"csrf": csrf}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login"
    with TestClient(app, cookies={COOKIE: secret}) as replay:  # the old cookie, replayed
        assert replay.get("/ui/runs", follow_redirects=False).status_code == 303


def test_a_sign_in_posted_from_another_site_is_refused(app: FastAPI, tenant: TenantHandle) -> None:
    """Login CSRF: another site's form could sign a visitor's browser in as the attacker's tenant."""
    with TestClient(app) as client:
        for origin in ("https://evil.example", "null"):
            r = client.post("/ui/login", data={"key": tenant.key}, headers={"Origin": origin})
            assert r.status_code == 403 and COOKIE not in r.cookies, (origin, r.text)
        # This service's own page (a browser's Origin), also behind a proxy that rewrites Host.
        own = client.post("/ui/login", data={"key": tenant.key}, headers={"Origin": "http://testserver"})
        assert own.status_code == 200 and COOKIE in client.cookies
        # X-Forwarded-Host is a proxy's word only when the deployment names its proxies; without
        # FORWARDED_ALLOW_IPS any client could name the Origin's host in it.
        proxied = {"Origin": "https://loraloom.example", "X-Forwarded-Host": "loraloom.example"}
        client.cookies.clear()
        unproxied = client.post("/ui/login", data={"key": tenant.key}, headers=proxied)
        assert unproxied.status_code == 403 and unproxied.json()["error"]["code"] == "csrf_failed"
        assert COOKIE not in client.cookies
        with pytest.MonkeyPatch.context() as env:
            env.setenv("FORWARDED_ALLOW_IPS", "127.0.0.1")
            assert client.post("/ui/login", data={"key": tenant.key}, headers=proxied).status_code == 200


def test_secure_cookie_over_https(app: FastAPI, tenant: TenantHandle) -> None:
    with TestClient(app, base_url="https://testserver") as client:
        r = client.post("/ui/login", data={"key": tenant.key}, follow_redirects=False)
        assert "Secure" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]


def test_runs_page_shows_only_own_runs_and_filters(app: FastAPI, client: TestClient) -> None:
    mine, theirs = new_tenant(client), new_tenant(client)
    a = create_run(client, mine, name="alpha-run", max_steps=7)
    b = create_run(client, mine, name="beta-run")
    other = create_run(client, theirs, name="secret-run")
    with TestClient(app) as ui:
        sign_in(ui, mine.key)
        page = ui.get("/ui/runs").text
        assert a["id"] in page and b["id"] in page and other["id"] not in page and "secret-run" not in page
        assert 'max="7"' in page  # the progress bar of alpha-run
        filtered = ui.get("/ui/runs", params={"name": "alpha"}).text
        assert a["id"] in filtered and b["id"] not in filtered
        assert ui.get("/ui/runs", params={"status": "evicted"}).text.count("data-run-id") == 0
        assert ui.get("/ui/runs", params={"status": "bogus"}).status_code == 422


def _ui_run_routes() -> list[tuple[str, str]]:
    """Every dashboard route under /ui/runs/{run_id}, read from its router (later routes are covered)."""
    out = []
    for route in ui_router.routes:
        path: str = getattr(route, "path", "")
        if path.startswith("/ui/runs/{run_id}"):
            for method in sorted(getattr(route, "methods", None) or ()):
                if method != "HEAD":
                    out.append((method, path))
    return out


def test_dashboard_tenant_isolation_table(app: FastAPI, client: TestClient) -> None:
    owner, stranger = new_tenant(client), new_tenant(client)
    run = create_run(client, owner)
    routes = _ui_run_routes()
    assert {p for _, p in routes} >= {
        "/ui/runs/{run_id}",
        "/ui/runs/{run_id}/events",
        "/ui/runs/{run_id}/evict",
        "/ui/runs/{run_id}/adapters/{step}",
    }
    with TestClient(app) as ui:
        csrf = sign_in(ui, stranger.key)
        for method, path in routes:
            url = path.replace("{run_id}", run["id"]).replace("{step}", "1")
            data = {"csrf": csrf, "confirm": "yes", "reason": "x"} if method == "POST" else None
            r = ui.request(method, url, data=data)
            assert r.status_code == 404, (method, path, r.status_code)
            assert r.json()["error"]["code"] == "not_found"
    assert client.get(f"/v1/runs/{run['id']}", headers=owner.headers).json()["status"] == "active"


def test_evict_needs_csrf_and_confirmation(app: FastAPI, tenant: TenantHandle, client: TestClient) -> None:
    run = create_run(client, tenant)
    with TestClient(app) as ui:
        csrf = sign_in(ui, tenant.key)
        url = f"/ui/runs/{run['id']}/evict"
        forged = ui.post(url, data={"confirm": "yes", "reason": "forged"})
        assert forged.status_code == 403 and forged.json()["error"]["code"] == "csrf_failed"
        assert ui.post(url, data={"csrf": "nope", "confirm": "yes"}).status_code == 403
        assert ui.post(url, data={"csrf": csrf}).json()["error"]["code"] == "not_confirmed"
        assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["status"] == "active"
        r = ui.post(
            url, data={"csrf": csrf, "confirm": "yes", "reason": "from the UI"}, follow_redirects=False
        )
        assert r.status_code == 303
    out = client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()
    assert (
        out["status"] == "evicted" and out["evicted_by"] == "user" and out["eviction_reason"] == "from the UI"
    )


def test_admin_view(app: FastAPI, tenant: TenantHandle) -> None:
    with TestClient(app) as ui:
        sign_in(ui, tenant.key)
        assert ui.get("/ui/admin").status_code == 403
    with TestClient(app) as admin:
        r = admin.post("/ui/login", data={"key": ADMIN_KEY}, follow_redirects=False)
        assert r.headers["location"] == "/ui/admin"
        page = admin.get("/ui/admin")
        assert page.status_code == 200 and tenant.name in page.text and tenant.id in page.text
        assert admin.get("/ui/pools").status_code == 200


@pytest.mark.parametrize("path", ["/ui/login", "/ui/runs", "/ui/pools", "/ui/static/run.js"])
def test_security_headers(app: FastAPI, tenant: TenantHandle, path: str) -> None:
    with TestClient(app) as ui:
        sign_in(ui, tenant.key)
        r = ui.get(path)
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert csp == CSP and "unsafe-inline" not in csp and "script-src 'self'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        assert "<script>" not in r.text  # no inline script anywhere (data blocks are type=application/json)
