"""`loraloom runs create` with YAML files against a live service: YAML 1.2 scalars reach it as the
user wrote them. With PyYAML's YAML 1.1 rules, `lr: 1e-3` was sent as the string "1e-3" and refused
("must be a number"), and `heartbeat_timeout: 1:30` was sent as 90 without a word. The parsing
itself is tested without a service in tests/test_cli_inputs.py."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from loraloom.cli import cli
from tests.app.api import new_tenant

runner = CliRunner()


@pytest.fixture
def tenant_env(live_server: Any) -> Iterator[dict[str, str]]:
    with httpx.Client(base_url=live_server.url, timeout=30) as http:
        tenant = new_tenant(http)
    yield {"LORALOOM_URL": live_server.url, "LORALOOM_API_KEY": tenant.key}


def test_a_learning_rate_in_e_notation_creates_the_run(tenant_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "lr.yaml"
    path.write_text("max_steps: 5\noptim:\n  lr: 1e-3\nmetadata:\n  on: yes\n  seed_hex: 0x1F\n")
    result = runner.invoke(cli, ["runs", "create", str(path), "--json"], env=tenant_env)
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)
    assert run["name"] == "lr" and run["config"]["optim"]["lr"] == 0.001
    assert run["config"]["metadata"] == {"on": "yes", "seed_hex": 31}  # YAML 1.1: {True: True}


def test_a_sexagesimal_looking_value_is_refused_not_read_as_90(
    tenant_env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "hb.yaml"
    path.write_text("max_steps: 5\nheartbeat_timeout: 1:30\n")
    result = runner.invoke(cli, ["runs", "create", str(path)], env=tenant_env)
    assert result.exit_code == 2, result.output
    assert "HTTP 422" in result.output and "config.heartbeat_timeout" in result.output
    with httpx.Client(base_url=tenant_env["LORALOOM_URL"], timeout=30) as http:
        runs = http.get("/v1/runs", headers={"Authorization": f"Bearer {tenant_env['LORALOOM_API_KEY']}"})
    assert runs.json()["items"] == []  # nothing stored
