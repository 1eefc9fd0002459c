"""Shared fixtures. The database is real: Postgres (default) or SQLite
(LORALOOM_TEST_DB=sqlite), created fresh through Alembic migrations."""

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from app import migrate
from app.config import Settings
from app.db import make_engine
from app.models import Base

PG_ADMIN_URL = os.environ.get(
    "LORALOOM_TEST_PG_ADMIN_URL", "postgresql+psycopg://root@127.0.0.1:5432/postgres"
)
ADMIN_KEY = "admin-test-key"
WORKER_TOKEN = "worker-test-token"

# Keep torch to the two cores CI has, and quiet.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def test_backend() -> str:
    backend = os.environ.get("LORALOOM_TEST_DB", "postgres")
    if backend not in {"postgres", "sqlite"}:
        raise RuntimeError(f"LORALOOM_TEST_DB must be postgres or sqlite, not {backend!r}")
    return backend


def pytest_collection_modifyitems(config, items):
    if test_backend() == "sqlite":
        skip = pytest.mark.skip(reason="needs Postgres (LORALOOM_TEST_DB=sqlite)")
        for item in items:
            if "postgres_only" in item.keywords:
                item.add_marker(skip)


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


@pytest.fixture(scope="session")
def migrated_database_url(tmp_path_factory) -> Iterator[str]:
    """One database per test session, migrated to head."""
    if test_backend() == "postgres":
        url = create_postgres_database()
        migrate.upgrade(url)
        yield url
        drop_postgres_database(url)
    else:
        path = tmp_path_factory.mktemp("db") / "loraloom.db"
        url = f"sqlite:///{path}"
        migrate.upgrade(url)
        yield url


@pytest.fixture
def database_url(migrated_database_url) -> Iterator[str]:
    """The session's database, emptied after each test."""
    yield migrated_database_url
    engine = make_engine(migrated_database_url)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
    engine.dispose()


@pytest.fixture
def settings(database_url, tmp_path: Path) -> Settings:
    return Settings(
        database_url=database_url,
        data_dir=tmp_path / "data",
        admin_key=ADMIN_KEY,
        worker_token=WORKER_TOKEN,
        max_concurrent_runs=2,
    )
