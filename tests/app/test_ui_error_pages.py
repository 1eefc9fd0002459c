"""The dashboard's errors, met by a browser's navigation, are pages: the admin view for a tenant
(403), a run that is not there (404), a sign-in key over 512 characters (422), a path the dashboard
does not have. Each answered the API's raw JSON error body. The page's scripts and EventSource (and
every API route) keep the JSON body they read. And a run's `latest` adapter downloads from the
dashboard as from the API (it was a 422)."""

import io
import re
import tarfile
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.ui.security import CSP
from tests.app.api import TenantHandle, create_run, new_tenant
from tests.app.test_adapters import adapter_tar, peft_dir, upload  # noqa: F401 (peft_dir: a fixture)
from tests.app.test_ui import sign_in

PAGE = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}  # a browser's navigation


def _is_page(r, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("text/html"), r.headers
    assert r.headers["content-security-policy"] == CSP  # in the dashboard's frame, its headers with it
    assert '<link rel="stylesheet" href="/ui/static/app.css">' in r.text
    assert f'data-status="{status}"' in r.text
    for word in words:
        assert word in r.text, r.text


def _is_json(r, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


def test_a_tenant_navigating_to_the_admin_view_gets_a_page(app: FastAPI, tenant: TenantHandle) -> None:
    with TestClient(app) as ui:
        sign_in(ui, tenant.key)
        _is_page(ui.get("/ui/admin", headers=PAGE), 403, "Not allowed", "the admin view needs the admin key")
        _is_json(ui.get("/ui/admin"), 403, "forbidden")  # a script's request: the body it can read


def test_a_run_that_is_not_there_is_a_page(app: FastAPI, client: TestClient) -> None:
    owner, stranger = new_tenant(client), new_tenant(client)
    run = create_run(client, owner)
    with TestClient(app) as ui:
        sign_in(ui, stranger.key)
        for path in (
            f"/ui/runs/{run['id']}",
            "/ui/runs/run_000000000000",
            f"/ui/runs/{run['id']}/adapters/1",
        ):
            _is_page(ui.get(path, headers=PAGE), 404, "Not found", 'href="/ui"')
        # The run page's EventSource and its scripts' probe keep the JSON body (app/ui/static/run.js).
        events = f"/ui/runs/{run['id']}/events"
        _is_json(ui.get(events, headers={"Accept": "text/event-stream"}), 404, "not_found")
        _is_json(
            ui.get(events, params={"cursor": "probe"}, headers={"Accept": "application/json"}),
            404,
            "not_found",
        )
        _is_page(ui.get("/ui/no-such-page", headers=PAGE), 404, "Not found")
        _is_json(ui.get("/ui/no-such-page"), 404, "not_found")


def test_a_sign_in_key_too_long_to_be_one_is_a_page_that_does_not_echo_it(app: FastAPI) -> None:
    key = "k" * 513
    with TestClient(app) as ui:
        r = ui.post("/ui/login", data={"key": key}, headers=PAGE)
        _is_page(
            r, 422, "Invalid request", "key: String should have at most 512 characters", 'href="/ui/login"'
        )
        assert key not in r.text
        _is_json(ui.post("/ui/login", data={"key": key}), 422, "validation_error")
        # The form says so before it is sent.
        assert 'maxlength="512"' in ui.get("/ui/login").text


def test_form_posts_refused_are_pages(app: FastAPI, tenant: TenantHandle, client: TestClient) -> None:
    run = create_run(client, tenant)
    with TestClient(app) as ui:
        csrf = sign_in(ui, tenant.key)
        url = f"/ui/runs/{run['id']}/evict"
        _is_page(ui.post(url, data={"csrf": "nope", "confirm": "yes"}, headers=PAGE), 403, "CSRF")
        _is_page(ui.post(url, data={"csrf": csrf}, headers=PAGE), 403, "eviction not confirmed")
    with TestClient(app) as signed_out:
        _is_page(signed_out.post(url, data={"confirm": "yes"}, headers=PAGE), 401, 'href="/ui/login"')
    assert client.get(f"/v1/runs/{run['id']}", headers=tenant.headers).json()["status"] == "active"


def test_the_api_keeps_its_json_for_a_browser_too(client: TestClient, tenant: TenantHandle) -> None:
    _is_json(client.get("/v1/runs/run_000000000000", headers=PAGE | tenant.headers), 404, "not_found")
    _is_json(client.get("/v1/no-such-route", headers=PAGE), 404, "not_found")


def test_the_latest_adapter_downloads_from_the_dashboard(
    app: FastAPI,
    client: TestClient,
    tenant: TenantHandle,
    peft_dir: Path,  # noqa: F811 (the fixture, imported)
) -> None:
    run = create_run(client, tenant)
    with TestClient(app) as ui:
        sign_in(ui, tenant.key)
        latest = f"/ui/runs/{run['id']}/adapters/latest"
        _is_page(ui.get(latest, headers=PAGE), 404, f"run {run['id']} has no adapter yet")
        tar = adapter_tar(peft_dir)
        for step in (1, 2):
            assert upload(client, run["id"], step, tar).status_code == 201
        r = ui.get(latest, headers=PAGE)
        assert r.status_code == 200, r.text
        assert re.search(rf'filename="{run["id"]}_step_2\.tar\.gz"', r.headers["content-disposition"])
        with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as archive:
            assert "adapter_config.json" in archive.getnames()
        assert ui.get(f"/ui/runs/{run['id']}/adapters/1").status_code == 200
        for bad in ("newest", "-1", "1" * 10):
            _is_json(ui.get(f"/ui/runs/{run['id']}/adapters/{bad}"), 422, "validation_error")
