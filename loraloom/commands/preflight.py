"""What `loraloom serve` checks before it starts uvicorn, so that the usual setup mistakes are one
`error:` line with a hint and the exit code of the README's table, not uvicorn's startup traceback
(100-200 lines, exit 3, which the table calls "not found"): the database URL, reaching the
database, its schema at the migration head, a writable data directory, a free port."""

import contextlib
import errno
import socket
import tempfile
from pathlib import Path
from typing import Any

from loraloom.commands.errors import CliError, ExitCode

DATABASE_URL_HINT = (
    "LORALOOM_DATABASE_URL is e.g. postgresql+psycopg://user@host:5432/db or sqlite:///path/to.db"
)


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL (as given: relative to the working directory); None for another
    database, an in-memory one or a URL that does not parse (each reported on its own)."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return None
    if parsed.get_backend_name() != "sqlite" or in_memory_sqlite(url):
        return None
    return Path(parsed.database or "")


def in_memory_sqlite(url: str) -> bool:
    """`sqlite://`, `sqlite:///:memory:` or a `mode=memory` URI: a database each connection gets
    empty and of its own (the service opens many), that no migration outlives."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return False
    return parsed.get_backend_name() == "sqlite" and (
        parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"
    )


def refuse_in_memory(url: str) -> None:
    """In-memory SQLite is not supported: the service does not migrate at start (`db upgrade` does,
    and its database would be gone with its connection), and each of its connections would see an
    empty database of its own."""
    if in_memory_sqlite(url):
        raise CliError(
            "LORALOOM_DATABASE_URL is an in-memory SQLite database, which loraloom does not support: "
            "nothing migrates it at start, and each connection would get an empty one of its own",
            kind=ExitCode.USAGE,
            hint="use a file, e.g. sqlite:///./.loraloom/loraloom.db (the default), or Postgres",
        )


def _first_line(exc: Exception) -> str:
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def database_problem(exc: Exception, url: str | None = None) -> CliError | None:
    """The CLI's error for a failure to open or use LORALOOM_DATABASE_URL (`url`, to name a SQLite
    file); None for other errors."""
    from sqlalchemy.exc import ArgumentError, DatabaseError, NoSuchModuleError, OperationalError

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
    file = sqlite_file(url) if url is not None else None
    if isinstance(exc, OperationalError):
        if file is not None:  # no server to reach: the file (or its directory) is the problem
            return CliError(
                f"cannot use the SQLite database {file.resolve()}: {_first_line(exc)}",
                kind=ExitCode.UNAVAILABLE,
                hint="check that file and its directory (permissions, free space), or LORALOOM_DATABASE_URL",
            )
        return CliError(
            f"cannot reach the database: {_first_line(exc)}",
            kind=ExitCode.UNAVAILABLE,
            hint="is the database running? check LORALOOM_DATABASE_URL",
        )
    # Any other error of the database itself (OperationalError is one too, above): a file that is
    # not a SQLite database ("file is not a database"), a Postgres user without the rights it needs.
    if isinstance(exc, DatabaseError):
        if file is not None:
            return CliError(
                f"{file.resolve()} is not a usable SQLite database: {_first_line(exc)}",
                kind=ExitCode.UNAVAILABLE,
                hint=f"LORALOOM_DATABASE_URL names {file}: point it at the service's database, or "
                "move that file away and run `loraloom db upgrade` to create a new one",
            )
        return CliError(
            f"the database refused: {_first_line(exc)}",
            kind=ExitCode.UNAVAILABLE,
            hint="check LORALOOM_DATABASE_URL and its user's rights on that database",
        )
    return None


def check_database(url: str) -> None:
    """The database answers and its schema is at the head this code expects (as /readyz checks)."""
    from app.migrate import database_revision, head_revision

    refuse_in_memory(url)
    file = sqlite_file(url)
    # Connecting would create an empty file there.
    if file is not None and not file.exists():
        raise CliError(
            f"no database at {file.resolve()}",
            kind=ExitCode.UNAVAILABLE,
            hint="run `loraloom db upgrade` (same LORALOOM_DATABASE_URL) to create it",
        )
    try:
        current = database_revision(url)
    except Exception as exc:
        if (problem := database_problem(exc, url)) is not None:
            raise problem from None
        raise
    head = head_revision()
    if current != head:
        raise CliError(
            f"the database schema is at {current or 'no revision'}; this service needs {head}",
            kind=ExitCode.UNAVAILABLE,
            hint="run `loraloom db upgrade` (same LORALOOM_DATABASE_URL) first",
        )


MIN_SECRET_CHARS = 16
"""Shorter service credentials are warned about at start (not refused: the README's walkthrough and
the tests use short ones on 127.0.0.1). 16 random URL-safe characters are 96 bits."""


def weak_credentials(settings: Any) -> list[str]:
    """A warning for each service credential shorter than MIN_SECRET_CHARS; it says the length and
    never the secret. (One equal to the other is refused by the settings themselves, app/config.py.)"""
    warnings = []
    for variable, secret, power in (
        ("LORALOOM_ADMIN_KEY", settings.admin_key, "creates tenants and their API keys"),
        ("LORALOOM_WORKER_TOKEN", settings.worker_token, "acts as a worker pool on every tenant's runs"),
    ):
        length = len(secret.get_secret_value()) if secret is not None else None
        if length is not None and length < MIN_SECRET_CHARS:
            warnings.append(
                f"{variable} is only {length} character{'s' if length != 1 else ''} long; whoever guesses "
                f"it {power}. Use at least {MIN_SECRET_CHARS} random characters, e.g. "
                "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
    return warnings


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
