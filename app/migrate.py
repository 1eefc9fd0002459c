"""Run Alembic migrations from code (CLI `loraloom db upgrade`, tests, service start-up).

The migrations ship inside the package (`app/migrations/`) and the Alembic config is built here,
so an installed wheel migrates from any directory; the repository's `alembic.ini` only serves
developers who run `alembic` by hand.
"""

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    if database_url.startswith("sqlite:///"):
        Path(database_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    """The newest revision of the migrations shipped with this code."""
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def schema_revision(conn: Connection) -> str | None:
    """The revision the database is at (None: never migrated)."""
    return MigrationContext.configure(conn).get_current_revision()


def database_revision(database_url: str) -> str | None:
    """`schema_revision` of the database at `database_url`, on a connection of its own."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return schema_revision(conn)
    finally:
        engine.dispose()
