"""What every test directory shares: the test credentials, the database backend under test, and a
wait on its locks.

A module of its own (not a conftest), so tests import it like any module; conftests hold
fixtures only.
"""

import os
import time
import uuid

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

PG_ADMIN_URL = os.environ.get(
    "LORALOOM_TEST_PG_ADMIN_URL", "postgresql+psycopg://root@127.0.0.1:5432/postgres"
)
ADMIN_KEY = "admin-test-key"
WORKER_TOKEN = "worker-test-token"


def backend_under_test() -> str:
    backend = os.environ.get("LORALOOM_TEST_DB", "postgres")
    if backend not in {"postgres", "sqlite"}:
        raise RuntimeError(f"LORALOOM_TEST_DB must be postgres or sqlite, not {backend!r}")
    return backend


def create_postgres_database() -> str:
    """A new empty database; returns its URL."""
    name = f"loraloom_test_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def drop_postgres_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


class FakeClock:
    """A clock for code that takes one (`clock=`): it reads `now`, which the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def wait_for_a_lock_waiter(watcher: Session, what: str) -> None:
    """Until a backend of the test database waits for a lock (Postgres; a bounded wait): the window of
    a race held open by a transaction the test keeps. `what` names the waiter for the failure."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        waiting = watcher.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        ).scalar_one()
        watcher.rollback()  # a new snapshot for the next look
        if waiting:
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} never waited for a lock")
