"""Shared fixtures. The database is real: Postgres (default) or SQLite
(LORALOOM_TEST_DB=sqlite), created fresh through Alembic migrations."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import migrate
from app.config import Settings
from app.db import make_engine
from app.models import Base
from tests.common import (
    ADMIN_KEY,
    WORKER_TOKEN,
    backend_under_test,
    create_postgres_database,
    drop_postgres_database,
)

# Keep torch to the two cores CI has, and quiet.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if backend_under_test() == "sqlite":
        skip = pytest.mark.skip(reason="needs Postgres (LORALOOM_TEST_DB=sqlite)")
        for item in items:
            if "postgres_only" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def migrated_database_url(tmp_path_factory) -> Iterator[str]:
    """One database per test session, migrated to head."""
    if backend_under_test() == "postgres":
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
        # Each scrape reads the database (tests scrape before and after what they count); the cache
        # of the default has its own tests (tests/app/test_hmet_metrics_cache.py).
        metrics_cache_seconds=0.0,
    )
