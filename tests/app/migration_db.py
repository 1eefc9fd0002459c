"""What the migration tests share: an empty database of the backend under test (dropped after), and
the one tenant row their hand-written SQL rows belong to (SQL of the old schema, not the models')."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, text

from tests import common


@contextmanager
def empty_database(tmp_path: Path, name: str = "empty") -> Iterator[str]:
    """The URL of a new, unmigrated database (a SQLite file under `tmp_path`)."""
    if common.backend_under_test() == "postgres":
        url = common.create_postgres_database()
        try:
            yield url
        finally:
            common.drop_postgres_database(url)
    else:
        yield f"sqlite:///{tmp_path / f'{name}.db'}"


def insert_tenant(conn: Connection, tenant_id: str = "t") -> None:
    conn.execute(
        text(
            "INSERT INTO tenants (id, name, max_concurrent_runs, created_at) "
            "VALUES (:id, :id, 4, CURRENT_TIMESTAMP)"
        ),
        {"id": tenant_id},
    )
