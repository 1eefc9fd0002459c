"""`loraloom tenants update TENANT --name NEW` renames a tenant (PATCH /v1/tenants/{id} `{"name"}`), with or
without `--max-concurrent-runs`/`--quota`, which is now optional; neither is a usage error naming both.
A name another tenant has whatever the case is exit 4 (the service's 409 naming that tenant). The quota's
own CLI checks are in tests/app/test_tenant_quota_update.py. Against the app under real uvicorn, on both
databases."""

import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from app.config import Settings
from app.main import create_app
from loraloom.cli import cli
from tests.app.api import LiveServer
from tests.common import ADMIN_KEY


@pytest.fixture
def env(settings: Settings) -> Iterator[dict[str, str]]:
    with LiveServer(create_app(settings)) as server:
        yield {"LORALOOM_URL": server.url, "LORALOOM_ADMIN_KEY": ADMIN_KEY}


def _invoke(env: dict[str, str], *args: str) -> Any:
    return CliRunner().invoke(cli, list(args), env=env)


def _create(env: dict[str, str], name: str) -> str:
    created = _invoke(env, "tenants", "create", name, "--json")
    assert created.exit_code == 0, created.output
    tenant_id: str = json.loads(created.stdout)["id"]
    return tenant_id


def _listed(env: dict[str, str]) -> dict[str, tuple[str, int]]:
    listed = _invoke(env, "tenants", "list", "--json")
    assert listed.exit_code == 0, listed.output
    return {t["id"]: (t["name"], t["max_concurrent_runs"]) for t in json.loads(listed.stdout)["items"]}


def test_the_cli_renames_a_tenant(env: dict[str, str]) -> None:
    tenant_id = _create(env, "acme")

    text = _invoke(env, "tenants", "update", tenant_id, "--name", "globex")
    assert text.exit_code == 0, text.output
    assert text.stdout == f"tenant globex: {tenant_id} (quota 2)\n"  # as `tenants create` says it

    both = _invoke(env, "tenants", "update", tenant_id, "--name", "Globex", "--quota", "5", "--json")
    assert both.exit_code == 0, both.output
    assert json.loads(both.stdout) | {"created_at": None} == {
        "id": tenant_id,
        "name": "Globex",
        "max_concurrent_runs": 5,
        "created_at": None,
    }
    assert _listed(env) == {tenant_id: ("Globex", 5)}


def test_the_cli_says_which_tenant_has_the_name_and_changes_nothing(env: dict[str, str]) -> None:
    holder = _create(env, "Initech")
    tenant_id = _create(env, "acme")
    taken = _invoke(env, "tenants", "update", tenant_id, "--name", "INITECH", "--quota", "7", "--json")
    assert taken.exit_code == 4, taken.output  # CONFLICT
    error = json.loads(taken.stderr)["error"]
    assert error["code"] == "conflict" and error["details"] == {"tenant_id": holder, "name": "Initech"}
    text = _invoke(env, "tenants", "update", tenant_id, "--name", "initech")
    assert text.exit_code == 4 and holder in text.stderr and "'Initech'" in text.stderr, text.output

    bad = _invoke(env, "tenants", "update", tenant_id, "--name", "has space", "--json")
    assert bad.exit_code == 2, bad.output  # the service's 422
    assert json.loads(bad.stderr)["error"]["details"][0]["loc"] == ["body", "name"]
    assert _listed(env) == {holder: ("Initech", 2), tenant_id: ("acme", 2)}


def test_nothing_to_change_is_a_usage_error_naming_both_options(env: dict[str, str]) -> None:
    tenant_id = _create(env, "acme")
    missing = _invoke(env, "tenants", "update", tenant_id)
    assert missing.exit_code == 2, missing.output
    assert "--max-concurrent-runs" in missing.output and "--name" in missing.output
    assert _listed(env) == {tenant_id: ("acme", 2)}
