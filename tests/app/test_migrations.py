"""Migrations: upgrade head on an empty database, downgrade to base, and no drift between
the ORM models and what the migrations create (on the backend under test)."""

import json
from collections.abc import Iterator
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from app import migrate
from app.db import make_engine
from app.models import Base
from tests.app.migration_db import empty_database, insert_tenant


@pytest.fixture
def empty_database_url(tmp_path) -> Iterator[str]:
    with empty_database(tmp_path) as url:
        yield url


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _drift(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def test_upgrade_downgrade_and_no_drift(empty_database_url):
    url = empty_database_url
    assert _tables(url) == set()
    migrate.upgrade(url)
    assert _tables(url) == set(Base.metadata.tables) | {"alembic_version"}
    assert _drift(url) == []

    migrate.downgrade(url, "base")
    assert _tables(url) <= {"alembic_version"}

    # And back up again: the downgrade left nothing behind that blocks it.
    migrate.upgrade(url)
    assert _drift(url) == []


def _migrated_index(url: str, table: str, name: str) -> dict[str, Any]:
    """Index `name` of `table` after migrating the empty database at `url` to head, as the inspector
    reports it (partial predicates under ``dialect_options``)."""
    migrate.upgrade(url)
    engine = make_engine(url)
    try:
        indexes = {ix["name"]: ix for ix in inspect(engine).get_indexes(table)}
    finally:
        engine.dispose()
    return dict(indexes[name])


def test_partial_slot_index_exists(empty_database_url):
    """The index that guarantees slots is partial (active runs only) on both backends."""
    ix = _migrated_index(empty_database_url, "runs", "uq_runs_active_slot")
    assert ix["unique"] and ix["column_names"] == ["base_model", "slot"]
    where = ix.get("dialect_options", {})
    assert any("active" in str(v) for v in where.values()), where


def test_partial_claimable_index_exists(empty_database_url):
    """The Tinker claim's index (migration 0008) is partial, on the claimable futures, on both backends."""
    ix = _migrated_index(empty_database_url, "tinker_futures", "ix_tinker_futures_claimable")
    assert ix["column_names"] == ["run_id", "seq_id"] and not ix["unique"]
    where = " ".join(str(v) for v in ix.get("dialect_options", {}).values())
    assert "pending" in where and "forward_backward" in where and "load_weights" in where, where


def test_partial_live_sessions_index_exists(empty_database_url):
    """The live-session count's index (migration 0010) is partial, on the unfinished sessions."""
    ix = _migrated_index(empty_database_url, "tinker_sessions", "ix_tinker_sessions_live")
    assert ix["column_names"] == ["tenant_id", "last_heartbeat_at"] and not ix["unique"]
    where = " ".join(str(v) for v in ix.get("dialect_options", {}).values())
    assert "finished_at IS NULL" in where, where


def test_tokens_of_stored_requests_are_counted_on_upgrade(empty_database_url):
    """Migration 0012 adds `tinker_futures.tokens`, which the claim cuts its rounds by: requests
    stored before it get their count, not 0, which would let a claim take a whole queue in one round."""
    url = empty_database_url
    migrate.upgrade(url, "0011")
    fwd = {"kind": "forward_backward", "data": [{"tokens": [1, 2, 3]}, {"tokens": [4, 5]}]}
    sample = {
        "kind": "sample",
        "data": [],
        "sampling": {"num_samples": 2, "prompt": [1, 2, 3], "max_tokens": 4},
    }
    requests = {f"fwd{i:04}": fwd for i in range(600)} | {
        "sample": sample,
        "step": {"kind": "optim_step", "data": []},
        "cleared": None,
        "json_null": "null",  # how the ORM stores a request it cleared
    }
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            insert_tenant(conn)
            conn.execute(
                text(
                    "INSERT INTO tinker_futures (id, tenant_id, kind, status, request, created_at) "
                    "VALUES (:id, 't', 'forward_backward', 'pending', :request, CURRENT_TIMESTAMP)"
                ),
                [
                    {"id": key, "request": r if r is None or isinstance(r, str) else json.dumps(r)}
                    for key, r in requests.items()
                ],
            )
        migrate.upgrade(url)
        with engine.connect() as conn:
            tokens = dict(conn.execute(text("SELECT id, tokens FROM tinker_futures")).tuples().all())
    finally:
        engine.dispose()
    assert tokens == {f"fwd{i:04}": 5 for i in range(600)} | {
        "sample": 14,
        "step": 0,
        "cleared": 0,
        "json_null": 0,
    }
