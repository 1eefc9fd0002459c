"""Migration 0020 deletes the pending rollout batches of manual runs (Tinker models' runs): stored
through /v1 before the ingestion refused them (409 `run_is_manual`), they are never claimed
(app/batches/claims.py) and stayed pending for ever. The batches of other runs, and a manual run's
claimed and trained ones, stay; the deleted rows and bytes are added to the purged counts, so the
ingested-batches counters do not go down. Their payload files, then referenced by no row, go at the
service's next start-up (`remove_orphan_payloads`). Upgraded from 0019 on the backend under test."""

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from app import migrate
from app.batches.storage import remove_orphan_payloads
from app.config import Settings
from app.db import make_engine, make_session_factory
from contracts.ids import new_id
from contracts.layout import step_dir_name
from tests.app.migration_db import empty_database, insert_tenant


@pytest.fixture
def url_at_0019(tmp_path: Path) -> Iterator[str]:
    """An empty database migrated to 0019, the revision before."""
    with empty_database(tmp_path) as url:
        migrate.upgrade(url, "0019")
        yield url


def _insert(url: str, runs: dict[str, dict[str, object]], batches: list[dict[str, object]]) -> None:
    """A tenant, `runs` (id → config) and `batches`, in SQL: the schema of 0019, not the models'."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            insert_tenant(conn)
            conn.execute(
                text(
                    "INSERT INTO runs (id, tenant_id, name, config, base_model, status, step, total_tokens, "
                    "total_samples, submitted_samples, created_at, updated_at) VALUES (:id, 't', :id, "
                    ":config, 'loraloom-tiny', 'active', 0, 0, 0, 0, CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                ),
                [{"id": run_id, "config": json.dumps(config)} for run_id, config in runs.items()],
            )
            conn.execute(
                text(
                    "INSERT INTO batches (id, run_id, request_hash, rollout_step, num_samples, num_tokens, "
                    "sample_offset, payload_path, payload_bytes, payload_sha256, state, created_at) "
                    "VALUES (:id, :run_id, 'h', 0, 1, 1, 0, :payload_path, :payload_bytes, 's', :state, "
                    "CURRENT_TIMESTAMP)"
                ),
                batches,
            )
    finally:
        engine.dispose()


def _rows(url: str, query: str) -> dict[object, object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(text(query)).tuples().all())
    finally:
        engine.dispose()


def test_pending_batches_of_manual_runs_are_deleted_and_counted_as_purged(
    url_at_0019: str, tmp_path: Path
) -> None:
    url = url_at_0019
    manual, rollout, older = new_id("run"), new_id("run"), new_id("run")
    runs: dict[str, dict[str, object]] = {
        manual: {"mode": "manual", "base_model": "loraloom-tiny"},
        rollout: {"mode": "rollout", "base_model": "loraloom-tiny"},
        older: {"base_model": "loraloom-tiny"},  # a config stored before `mode` existed: rollout
    }
    states = [
        (1, manual, "pending", 100),
        (2, manual, "pending", 50),
        (3, manual, "claimed", 7),
        (4, manual, "trained", 7),
        (5, rollout, "pending", 7),
        (6, older, "pending", 7),
    ]
    data_dir = tmp_path / "data"
    batches = []
    for batch_id, run_id, state, size in states:
        path = f"runs/{run_id}/rollouts/{step_dir_name(0)}/batch_{batch_id}.msgpack"
        (data_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (data_dir / path).write_bytes(b"x" * size)
        batches.append(
            {"id": batch_id, "run_id": run_id, "state": state, "payload_path": path, "payload_bytes": size}
        )
    _insert(url, runs, batches)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:  # what the retention purge counted already
            conn.execute(text("INSERT INTO purged_counts (name, value) VALUES ('batches', 10)"))
    finally:
        engine.dispose()

    migrate.upgrade(url)

    assert _rows(url, "SELECT id, state FROM batches") == {
        3: "claimed",
        4: "trained",
        5: "pending",
        6: "pending",
    }
    assert _rows(url, "SELECT name, value FROM purged_counts") == {"batches": 12, "batch_bytes": 150}

    # The rows went, their files are orphans: the start-up's clean-up removes those two only.
    settings = Settings(database_url=url, data_dir=data_dir)
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session:
            assert remove_orphan_payloads(session, settings=settings) == 2
    finally:
        engine.dispose()
    left = sorted(p.name for p in (data_dir / "runs").rglob("batch_*.msgpack"))
    assert left == [f"batch_{i}.msgpack" for i in (3, 4, 5, 6)]


def test_nothing_to_delete_adds_no_purged_count(url_at_0019: str) -> None:
    url = url_at_0019
    rollout = new_id("run")
    _insert(
        url,
        {rollout: {"mode": "rollout"}},
        [{"id": 1, "run_id": rollout, "state": "pending", "payload_path": "p", "payload_bytes": 5}],
    )
    migrate.upgrade(url)
    assert _rows(url, "SELECT id, state FROM batches") == {1: "pending"}
    assert _rows(url, "SELECT name, value FROM purged_counts") == {}
