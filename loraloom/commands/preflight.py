"""What `loraloom serve` checks before it starts uvicorn, so that the usual setup mistakes are one
`error:` line with a hint and the exit code of the README's table, not uvicorn's startup traceback
(100-200 lines, exit 3, which the table calls "not found"): the database URL, reaching the
database, its schema at the migration head, a writable data directory, a free port."""

import contextlib
import errno
import socket
import tempfile
from pathlib import Path

from loraloom.commands.errors import CliError, ExitCode

DATABASE_URL_HINT = (
    "LORALOOM_DATABASE_URL is e.g. postgresql+psycopg://user@host:5432/db or sqlite:///path/to.db"
)


def database_problem(exc: Exception) -> CliError | None:
    """The CLI's error for a failure to open LORALOOM_DATABASE_URL; None for other errors."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

    if isinstance(exc, ModuleNotFoundError):
        return CliError(
            f"the database driver for LORALOOM_DATABASE_URL is not installed: {exc}",
            kind=ExitCode.USAGE,
            hint=DATABASE_URL_HINT + " (their drivers come with loraloom)",
        )
    if isinstance(exc, ArgumentError | NoSuchModuleError):
        return CliError(
            f"LORALOOM_DATABASE_URL is not a URL loraloom can use: {exc}",
            kind=ExitCode.USAGE,
            hint=DATABASE_URL_HINT,
        )
    if isinstance(exc, OperationalError):
        return CliError(
            f"cannot reach the database: {str(exc.orig).strip().splitlines()[0]}",
            kind=ExitCode.UNAVAILABLE,
            hint="is the database running? check LORALOOM_DATABASE_URL",
        )
    return None


def check_database(url: str) -> None:
    """The database answers and its schema is at the head this code expects (as /readyz checks)."""
    from sqlalchemy import make_url

    from app.migrate import database_revision, head_revision

    try:
        parsed = make_url(url)
        file = Path(parsed.database or ":memory:")
        # Connecting would create an empty file there.
        if parsed.get_backend_name() == "sqlite" and str(file) != ":memory:" and not file.exists():
            raise CliError(
                f"no database at {file.resolve()}",
                kind=ExitCode.UNAVAILABLE,
                hint="run `loraloom db upgrade` (same LORALOOM_DATABASE_URL) to create it",
            )
        current = database_revision(url)
    except CliError:
        raise
    except Exception as exc:
        if (problem := database_problem(exc)) is not None:
            raise problem from None
        raise
    head = head_revision()
    if current != head:
        raise CliError(
            f"the database schema is at {current or 'no revision'}; this service needs {head}",
            kind=ExitCode.UNAVAILABLE,
            hint="run `loraloom db upgrade` (same LORALOOM_DATABASE_URL) first",
        )


def check_data_dir(path: str) -> None:
    """The directory exists or can be made, and a file can be written in it."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".loraloom-probe-"):
            pass
    except OSError as exc:
        raise CliError(
            f"the data directory {directory} is not usable: {exc.strerror or exc}",
            kind=ExitCode.USAGE,
            hint="set LORALOOM_DATA_DIR to a directory this user can write",
        ) from None


def check_port(host: str, port: int, *, flag: str = "--port") -> None:
    """Nothing listens on (host, port) yet: uvicorn (or torchrun's rendezvous) would find out only
    after the whole startup. `flag`: the option that chose the port, for the hint."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CliError(
            f"cannot listen on {host}: {exc.strerror}", kind=ExitCode.USAGE, hint="check --host"
        ) from None
    family, kind, proto, _, address = infos[0]
    with contextlib.closing(socket.socket(family, kind, proto)) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise CliError(
                f"cannot listen on {host}:{port}: {'the port is in use' if taken else exc.strerror}",
                kind=ExitCode.UNAVAILABLE if taken else ExitCode.USAGE,
                hint=f"choose another {flag}, or stop what listens there"
                if taken
                else f"check --host and {flag}",
            ) from None
