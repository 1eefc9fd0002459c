"""`loraloom runs evict` without --reason: the run is evicted with the CLI's default reason, as the
dashboard's form evicts with its own (the API itself requires one: a 422 without it)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraloom.cli import EVICTED_FROM_THE_CLI, cli
from tests.common import ADMIN_KEY

runner = CliRunner()


def _ok(*args: str, env: dict[str, str]) -> str:
    result = runner.invoke(cli, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture
def tenant_env(live_server) -> dict[str, str]:
    env = {"LORALOOM_URL": live_server.url, "LORALOOM_ADMIN_KEY": ADMIN_KEY, "LORALOOM_API_KEY": ""}
    tenant = json.loads(_ok("tenants", "create", "acme", "--quota", "4", "--json", env=env))
    key = json.loads(_ok("keys", "create", tenant["id"], "--json", env=env))["key"]
    return {**env, "LORALOOM_API_KEY": key}


@pytest.mark.parametrize(
    "reason_args",
    [[], ["--reason", ""], ["--reason", " \t"]],
    ids=["left-out", "empty", "blank"],
)
def test_evict_without_a_reason_uses_the_default(
    tenant_env: dict[str, str], tmp_path: Path, settings, reason_args: list[str]
) -> None:
    config = tmp_path / "math.toml"
    config.write_text("max_steps = 5\n")
    run_id = json.loads(_ok("runs", "create", str(config), "--json", env=tenant_env))["id"]

    evicted = json.loads(_ok("runs", "evict", run_id, *reason_args, "--json", env=tenant_env))

    assert (evicted["status"], evicted["evicted_by"]) == ("evicted", "user")
    assert evicted["eviction_reason"] == EVICTED_FROM_THE_CLI
    evicted_txt = settings.runs_dir / run_id / "control" / "evicted.txt"
    assert evicted_txt.read_text() == EVICTED_FROM_THE_CLI + "\n"


def test_a_given_reason_is_sent_as_written(tenant_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "math.toml"
    config.write_text("max_steps = 5\n")
    run_id = json.loads(_ok("runs", "create", str(config), "--json", env=tenant_env))["id"]
    evicted = json.loads(_ok("runs", "evict", run_id, "--reason", " plateau ", "--json", env=tenant_env))
    assert evicted["eviction_reason"] == " plateau "


def test_evict_help_says_the_default_and_not_required() -> None:
    result = runner.invoke(cli, ["runs", "evict", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    reason_row = next(line for line in result.output.splitlines() if "--reason" in line)
    assert "required" not in reason_row
    assert f"[default: {EVICTED_FROM_THE_CLI}]" in result.output
