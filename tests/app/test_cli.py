"""The CLI against a live service (uvicorn in a thread), as the README uses it."""

import errno
import json
import socket
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraloom.cli import cli, interim_demo
from loraloom.launch import free_port
from tests.common import ADMIN_KEY

runner = CliRunner()


def _run(*args: str, env: dict[str, str]) -> str:
    result = runner.invoke(cli, list(args), env=env)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def env(live_server) -> dict[str, str]:
    return {"LORALOOM_URL": live_server.url, "LORALOOM_ADMIN_KEY": ADMIN_KEY, "LORALOOM_API_KEY": ""}


def test_cli_walkthrough(env, tmp_path, settings):
    tenant = json.loads(_run("tenants", "create", "acme", "--quota", "1", "--json", env=env))
    assert tenant["max_concurrent_runs"] == 1
    assert "acme" in _run("tenants", "list", env=env)
    key = json.loads(_run("keys", "create", tenant["id"], "--json", env=env))["key"]
    tenant_env = {**env, "LORALOOM_API_KEY": key}

    # A bare config in TOML (name from the file), and a whole body in JSON.
    toml_file = tmp_path / "math.toml"
    toml_file.write_text("max_steps = 20\n\n[lora]\nrank = 4\n")
    out = _run("runs", "create", str(toml_file), env=tenant_env)
    run_id = out.split()[0]
    assert "math" in out and "active, slot 0" in out
    json_file = tmp_path / "body.json"
    json_file.write_text(json.dumps({"name": "second", "config": {"max_steps": 5}}))
    second = json.loads(_run("runs", "create", str(json_file), "--name", "renamed", "--json", env=tenant_env))
    assert (second["name"], second["status"]) == ("renamed", "queued")

    listing = _run("runs", "list", env=tenant_env)
    assert run_id in listing and second["id"] in listing and "STATUS" in listing
    shown = _run("runs", "show", run_id, env=tenant_env)
    assert "status:" in shown and "active" in shown and "step 0/20" in shown

    out = _run("runs", "evict", run_id, "--reason", "enough", env=tenant_env)
    assert "evicted" in out
    assert json.loads(_run("runs", "show", second["id"], "--json", env=tenant_env))["status"] == "active"
    assert "deleted" in _run("runs", "delete", run_id, env=tenant_env)
    assert (settings.runs_dir / run_id).exists() is False


def test_cli_errors_are_readable(env, tmp_path):
    result = runner.invoke(cli, ["runs", "list"], env=env)
    assert result.exit_code == 5 and "no key" in result.output
    result = runner.invoke(cli, ["runs", "list", "--key", "llk_wrong"], env=env)
    assert result.exit_code == 5 and "401 unauthorized" in result.output

    tenant = json.loads(_run("tenants", "create", "t", "--json", env=env))
    key = json.loads(_run("keys", "create", tenant["id"], "--json", env=env))["key"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[lora]\nrank = 0\nbogus = 1\n")
    result = runner.invoke(cli, ["runs", "create", str(bad), "--key", key], env=env)
    assert result.exit_code == 2
    assert "422 validation_error" in result.output
    assert "body.config.lora.rank" in result.output and "body.config.lora.bogus" in result.output

    result = runner.invoke(cli, ["tenants", "list", "--url", "http://127.0.0.1:9"], env=env)
    assert result.exit_code == 6 and "cannot reach" in result.output


def test_db_upgrade(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    out = _run("db", "upgrade", env={"LORALOOM_DATABASE_URL": url})
    assert "head" in out
    assert (tmp_path / "cli.db").exists()
    head = out.split()[3]  # "database schema at 0012 (head)"
    # `upgrade` never goes back: it says where the schema is, not the revision asked for.
    assert _run("db", "upgrade", "base", env={"LORALOOM_DATABASE_URL": url}).startswith(
        f"database schema at {head}"
    )
    unknown = runner.invoke(cli, ["db", "upgrade", "bogus"], env={"LORALOOM_DATABASE_URL": url})
    assert unknown.exit_code == 2 and "bogus" in unknown.output, unknown.output


def test_db_upgrade_with_the_database_down_is_one_line(tmp_path):
    result = runner.invoke(
        cli, ["db", "upgrade"], env={"LORALOOM_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:9/x"}
    )
    assert result.exit_code == 6, result.output
    assert result.output.startswith("error: cannot reach the database") and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 2  # the error and its hint


def test_version():
    assert _run("--version", env={}).strip() == _run("version", env={}).strip()
    assert _run("--version", env={}).startswith("loraloom ")


def test_interim_demo(tmp_path, capsys):
    # The test is that the port given is used, so it picks one: free when picked, but the other xdist
    # worker may take it before the demo binds it. Then the demo fails to bind, and another is tried.
    for _ in range(5):
        port = free_port()
        try:
            interim_demo(tmp_path / "demo", port=port)
            break
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            capsys.readouterr()  # the failed attempt's output
    else:
        pytest.fail("5 free ports in a row were taken before the demo could bind them")
    out = capsys.readouterr().out
    assert f"service on http://127.0.0.1:{port}:" in out  # --port was ignored
    assert "queued" in out and "evicted" in out and "HTTP 404 not_found" in out
    assert "globex-agent  active" in out
    # The command it ends with serves the demo's own database (a bare `loraloom serve` would not).
    assert f"LORALOOM_DATABASE_URL=sqlite:///{(tmp_path / 'demo').resolve()}/loraloom.db" in out


@pytest.mark.parametrize("interim", [False, True], ids=["demo", "interim"])
def test_the_demo_on_a_port_another_server_holds_is_a_usage_error(interim: bool):
    """Its service failed to bind, and the demo drove the other server (with its own keys)."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        args = ["demo", "--port", str(port), *(["--interim"] if interim else [])]
        result = runner.invoke(cli, args)
    assert result.exit_code == 6, result.output
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in result.output


def test_readme_gives_the_two_commands_and_the_curl_walkthrough():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    for call in (
        "POST $B/v1/tenants",
        "POST $B/v1/runs",
        "/evict",
        "-X DELETE $B/v1/runs/",
        "application/toml",
    ):
        assert call in readme, call


def test_serve_refuses_the_usual_setup_mistakes_in_one_line(tmp_path):
    """Each was uvicorn's startup traceback (100-200 lines) with exit 3 ("not found" in the README's
    table); now an error line and a hint, before anything listens."""
    migrated = tmp_path / "ok.db"
    _run("db", "upgrade", env={"LORALOOM_DATABASE_URL": f"sqlite:///{migrated}"})
    unmigrated = tmp_path / "empty.db"
    sqlite3.connect(unmigrated).close()
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    ok = {"LORALOOM_DATABASE_URL": f"sqlite:///{migrated}", "LORALOOM_DATA_DIR": str(tmp_path / "data")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cases = [
            ({"LORALOOM_DATABASE_URL": "garbage"}, [], 2, "LORALOOM_DATABASE_URL is not a URL"),
            (
                {"LORALOOM_DATABASE_URL": "postgres://x@127.0.0.1/x"},
                [],
                2,
                "LORALOOM_DATABASE_URL is not a URL",
            ),
            ({"LORALOOM_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:9/x"}, [], 6, "cannot reach"),
            ({"LORALOOM_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}"}, [], 6, "no database at"),
            ({"LORALOOM_DATABASE_URL": f"sqlite:///{unmigrated}"}, [], 6, "schema is at no revision"),
            ({"LORALOOM_DATA_DIR": str(a_file / "data")}, [], 2, "data directory"),
            ({}, ["--port", str(taken.getsockname()[1])], 6, "the port is in use"),
            ({}, ["--host", "bogus.invalid"], 2, "cannot listen on bogus.invalid"),  # .invalid never resolves
            # A bad setting names its variable (was pydantic's report, exit 1).
            ({"LORALOOM_MAX_CONCURRENT_RUNS": "abc"}, [], 2, "LORALOOM_MAX_CONCURRENT_RUNS"),
            ({"LORALOOM_SWEEP_INTERVAL_SECONDS": "-1"}, [], 2, "LORALOOM_SWEEP_INTERVAL_SECONDS"),
        ]
        for overrides, args, code, words in cases:
            result = runner.invoke(cli, ["serve", *args], env=ok | overrides)
            assert result.exit_code == code, (overrides, result.output)
            assert result.output.startswith("error: ") and words in result.output, result.output
            assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 2
    assert not (tmp_path / "none.db").exists()  # the check created no empty database
    # A port outside 0-65535 is a usage error (99999 listened on 34463, and said 99999).
    result = runner.invoke(cli, ["serve", "--port", "99999"], env=ok)
    assert result.exit_code == 2 and "0<=x<=65535" in result.output, result.output


def test_without_torch_the_worker_and_the_demo_say_which_extra_to_install(monkeypatch, tmp_path):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real_find_spec(name, *a)
    )
    env = {"LORALOOM_WORKER_TOKEN": "t", "LORALOOM_MODEL_CACHE": str(tmp_path)}
    for args in (["worker", "--url", "http://127.0.0.1:9"], ["demo", "--steps", "2"]):
        result = runner.invoke(cli, args, env=env)
        assert result.exit_code == 2, result.output
        assert "needs torch" in result.output and "loraloom[worker]" in result.output


def test_a_run_file_holds_the_body_or_the_config_with_its_name_beside_it(tmp_path):
    from loraloom.cli import load_run_file

    flat = tmp_path / "flat.toml"
    flat.write_text('name = "gsm8k"\nmax_steps = 5\n[lora]\nrank = 8\n')
    # `name` beside a bare config is the run's name, not a config field (was a 422 body.config.name).
    assert load_run_file(flat, None) == (
        {"name": "gsm8k", "config": {"max_steps": 5, "lora": {"rank": 8}}},
        "toml",
    )
    whole = tmp_path / "whole.yaml"
    whole.write_text("name: a\nconfig:\n  max_steps: 2\n")
    assert load_run_file(whole, None) == ({"name": "a", "config": {"max_steps": 2}}, "yaml")
    bare = tmp_path / "bare.json"
    bare.write_text('{"max_steps": 3}')
    assert load_run_file(bare, "override") == ({"name": "override", "config": {"max_steps": 3}}, "json")
    assert load_run_file(bare, None)[0]["name"] == "bare"
