"""`loraloom serve` and `loraloom db upgrade` on a database they cannot use: one error line naming the
problem (and the file), a hint, and the README's exit code for a database problem (6), not
"error: DatabaseError: (sqlite3.DatabaseError) file is not a database [SQL: PRAGMA ...]" with
exit 1 ("unexpected"). And `db upgrade`'s hints that did not apply: a revision the numbering skips
(0005), in-memory SQLite (which no command can migrate for the service)."""

import pytest
from sqlalchemy.exc import DatabaseError, ProgrammingError
from typer.testing import CliRunner, Result

from loraloom.cli import cli
from loraloom.commands import preflight, revisions
from loraloom.commands.errors import ExitCode

runner = CliRunner()


def _one_error(result: Result, code: int, *words: str) -> list[str]:
    lines = result.output.strip().splitlines()
    assert result.exit_code == code, result.output
    assert lines[0].startswith("error: ") and lines[-1].startswith("hint: ") and len(lines) == 2, lines
    assert "Traceback" not in result.output and "[SQL:" not in result.output
    for word in words:
        assert word in result.output, result.output
    return lines


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["db", "upgrade"]])
def test_a_file_that_is_not_a_database_is_a_database_problem_naming_it(tmp_path, command) -> None:
    bad = tmp_path / "bad.db"
    bad.write_text("garbage\n")
    env = {"LORALOOM_DATABASE_URL": f"sqlite:///{bad}", "LORALOOM_DATA_DIR": str(tmp_path / "data")}
    result = runner.invoke(cli, command, env=env)
    error, hint = _one_error(result, int(ExitCode.UNAVAILABLE), "is not a usable SQLite database")
    assert str(bad) in error and str(bad) in hint
    assert bad.read_text() == "garbage\n"  # left as it was


def test_another_database_error_is_one_too() -> None:
    """Postgres refusing a statement (a user without rights) is a DatabaseError as well."""
    refused = ProgrammingError("SELECT 1", {}, Exception("permission denied for schema public"))
    problem = preflight.database_problem(refused, "postgresql+psycopg://u@127.0.0.1/x")
    assert problem is not None and problem.kind == ExitCode.UNAVAILABLE
    assert problem.message == "the database refused: permission denied for schema public"
    plain = DatabaseError("PRAGMA x", {}, Exception("file is not a database"))
    problem = preflight.database_problem(plain, None)
    assert problem is not None and problem.kind == ExitCode.UNAVAILABLE
    assert preflight.database_problem(ValueError("x"), None) is None


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite+pysqlite://"])
@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["db", "upgrade"]])
def test_in_memory_sqlite_is_refused_as_unsupported(tmp_path, url, command) -> None:
    """`db upgrade` said "database schema at None (head)" (its database was gone with its
    connection), and `serve` then "run `loraloom db upgrade` first", which could never help."""
    env = {"LORALOOM_DATABASE_URL": url, "LORALOOM_DATA_DIR": str(tmp_path / "data")}
    result = runner.invoke(cli, command, env=env)
    error, hint = _one_error(result, int(ExitCode.USAGE), "in-memory SQLite", "does not support")
    assert "db upgrade" not in result.output and "sqlite:///" in hint


def test_an_unknown_revision_lists_the_known_ones(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    known = revisions.known_revisions()
    assert "0004" in known and "0006" in known and "0005" not in known  # the numbering skips 0005
    result = runner.invoke(cli, ["db", "upgrade", "0005"], env={"LORALOOM_DATABASE_URL": url})
    error, hint = _one_error(result, int(ExitCode.USAGE), "0005")
    assert (
        error
        == "error: there is no revision '0005': the migrations go from 0004 to 0006 (the numbering skips it)"
    )
    assert f"0001–0004, 0006–{known[-1]} (head)" in hint
    beyond = runner.invoke(cli, ["db", "upgrade", "9999"], env={"LORALOOM_DATABASE_URL": url})
    assert f"the newest (the head) is {known[-1]}" in _one_error(beyond, int(ExitCode.USAGE))[0]
    bogus = runner.invoke(cli, ["db", "upgrade", "bogus"], env={"LORALOOM_DATABASE_URL": url})
    _one_error(bogus, int(ExitCode.USAGE), "there is no revision 'bogus'", "the revisions are")


def test_describe_compresses_runs_of_numbers() -> None:
    assert revisions.describe(["0001", "0002", "0004"]) == "0001–0002, 0004 (head)"
    assert revisions.describe(["a1", "b2"]) == "a1, b2 (head)"
