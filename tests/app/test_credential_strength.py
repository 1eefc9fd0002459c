"""Weak service credentials: LORALOOM_ADMIN_KEY equal to LORALOOM_WORKER_TOKEN made every worker pool
host an admin, silently; it is refused at start (a config problem, exit 2). A key or token shorter
than 16 characters is warned about at start, loudly (not refused: the README's curl walkthrough and
the tests use short ones on 127.0.0.1). Neither message shows the secret."""

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from app.config import Settings
from loraloom.cli import cli
from loraloom.commands import preflight
from loraloom.commands.errors import ExitCode

runner = CliRunner()
SAME = "the-same-secret-for-both-0123456789"


def test_settings_refuse_the_admin_key_as_worker_token_without_showing_it() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(admin_key=SAME, worker_token=SAME)
    assert "LORALOOM_ADMIN_KEY and LORALOOM_WORKER_TOKEN are the same secret" in str(refused.value)
    assert SAME not in str(refused.value)  # what a traceback shows (hide_input_in_errors)
    # Each alone, or both different, is a service.
    Settings(admin_key=SAME)
    Settings(worker_token=SAME)
    Settings(admin_key=SAME, worker_token=SAME + "x")


def test_serve_refuses_them_equal_with_a_config_exit_code(tmp_path) -> None:
    env = {
        "LORALOOM_DATABASE_URL": f"sqlite:///{tmp_path / 'none.db'}",
        "LORALOOM_ADMIN_KEY": SAME,
        "LORALOOM_WORKER_TOKEN": SAME,
    }
    debug = runner.invoke(cli, ["--debug", "serve", "--port", "0"], env=env)  # the traceback
    assert SAME not in debug.output and SAME not in str(debug.exception)
    result = runner.invoke(cli, ["serve", "--port", "0"], env=env)
    assert result.exit_code == int(ExitCode.USAGE) and SAME not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert lines[0] == (
        "error: invalid service settings: LORALOOM_ADMIN_KEY and LORALOOM_WORKER_TOKEN are the same "
        "secret: every worker pool host would hold the admin key; give each its own"
    )
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert not (tmp_path / "none.db").exists()  # refused before the database is looked at


@pytest.mark.parametrize(
    ("admin", "token", "warned"),
    [
        ("a", "w" * 16, ["LORALOOM_ADMIN_KEY is only 1 character long"]),
        ("a" * 16, "short-token", ["LORALOOM_WORKER_TOKEN is only 11 characters long"]),
        ("adm", "tok", ["LORALOOM_ADMIN_KEY is only 3", "LORALOOM_WORKER_TOKEN is only 3"]),
        ("a" * 16, "w" * 16, []),
        (None, None, []),  # unset: the `note:` lines say so already
    ],
)
def test_short_credentials_are_warned_about_by_length_never_by_value(
    admin: str | None, token: str | None, warned: list[str]
) -> None:
    warnings = preflight.weak_credentials(Settings(admin_key=admin, worker_token=token))
    assert len(warnings) == len(warned)
    for warning, words in zip(warnings, warned, strict=True):
        assert warning.startswith(words) and f"at least {preflight.MIN_SECRET_CHARS}" in warning
        for secret in (admin, token):
            assert secret is None or f" {secret} " not in f" {warning} "


def test_serve_prints_the_warnings_before_it_starts(tmp_path, monkeypatch) -> None:
    """Up to where uvicorn would start (replaced here): the warning is on stderr, the secret is not."""
    import uvicorn

    url = f"sqlite:///{tmp_path / 'ok.db'}"
    assert runner.invoke(cli, ["db", "upgrade"], env={"LORALOOM_DATABASE_URL": url}).exit_code == 0
    started: list[bool] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: started.append(True))
    env = {
        "LORALOOM_DATABASE_URL": url,
        "LORALOOM_DATA_DIR": str(tmp_path / "data"),
        "LORALOOM_ADMIN_KEY": "hunter2",
        "LORALOOM_WORKER_TOKEN": "w" * 32,
    }
    result = runner.invoke(cli, ["serve", "--port", "0"], env=env)
    assert result.exit_code == 0 and started == [True], result.output
    assert "warning: LORALOOM_ADMIN_KEY is only 7 characters long" in result.output
    assert "hunter2" not in result.output and "LORALOOM_WORKER_TOKEN" not in result.output
