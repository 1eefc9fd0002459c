"""Migration 0021 adds `tinker_futures.superseded_at` and marks, in the rows already stored, every
completed save but the newest of its path (model, kind and the path its result names): the quotas
on saves count the newest save of each path alone (`ix_tinker_futures_current_saves`), so an older
save left unmarked would count, and a newest one marked would hide a kept path. Other futures,
pending saves and saves without a completion time are left alone. Upgraded from 0020 on the backend
under test; the downgrade takes the column away."""

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text

from app import migrate
from app.db import make_engine
from tests.app.migration_db import empty_database, insert_tenant


@pytest.fixture
def url_at_0020(tmp_path: Path) -> Iterator[str]:
    """An empty database migrated to 0020, the revision before."""
    with empty_database(tmp_path) as url:
        migrate.upgrade(url, "0020")
        yield url


SAMPLER, STATE = "save_weights_for_sampler", "save_weights"
SEGMENT = {SAMPLER: "sampler_weights", STATE: "weights"}


def _future(
    id: str,
    model: str,
    seq: int,
    *,
    kind: str = SAMPLER,
    name: str | None = "a",
    second: int | None,
    status: str = "complete",
) -> dict[str, Any]:
    """A future of the schema of 0020: a save completed at `second` names tinker://<model>/.../<name>."""
    path = None if name is None else f"tinker://{model}/{SEGMENT[kind]}/{name}"
    return {
        "id": id,
        "kind": kind,
        "model": model,
        "seq": seq,
        "status": status,
        "result": None if path is None else json.dumps({"path": path, "type": kind}),
        "at": None if second is None else datetime(2026, 1, 1, 0, 0, second, tzinfo=UTC),
    }


FUTURES = [
    # m1's sampler checkpoint "a", saved three times: the newest stays current. The last two
    # completed at the same time: the higher request number is the newer.
    _future("a1", "m1", 1, second=1),
    _future("a2", "m1", 2, second=2),
    _future("a3", "m1", 3, second=2),
    # Another name, another kind, another model: each its own path.
    _future("b1", "m1", 4, name="b", second=3),
    _future("w1", "m1", 5, kind=STATE, second=4),
    _future("w2", "m1", 6, kind=STATE, second=5),
    _future("o1", "m2", 1, second=1),
    # Completion times that disagree with the request numbers (a tie broken the other way, or a
    # clock skew): the higher request number is the save a path's reads take, so it stays current.
    _future("zc", "m1", 10, name="c", second=7),
    _future("c2", "m1", 11, name="c", second=6),
    # A pending save, a completed save without a completion time, another kind: untouched.
    _future("p1", "m1", 7, name=None, second=None, status="pending"),
    _future("n1", "m1", 8, second=None),
    _future("f1", "m1", 9, kind="forward_backward", name=None, second=6),
]


def test_older_saves_of_a_path_are_marked_superseded(url_at_0020: str) -> None:
    url = url_at_0020
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            insert_tenant(conn)
            conn.execute(
                text(
                    "INSERT INTO tinker_futures (id, tenant_id, kind, model_id, seq_id, status, result, "
                    "created_at, completed_at) VALUES (:id, 't', :kind, :model, :seq, :status, :result, "
                    "CURRENT_TIMESTAMP, :at)"
                ),
                FUTURES,
            )
        migrate.upgrade(url, "0021")
        with engine.connect() as conn:
            superseded = conn.execute(
                text("SELECT id FROM tinker_futures WHERE superseded_at IS NOT NULL ORDER BY id")
            ).scalars()
            assert list(superseded) == ["a1", "a2", "w1", "zc"]

        migrate.downgrade(url, "0020")
        columns = {c["name"] for c in inspect(engine).get_columns("tinker_futures")}
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("tinker_futures")}
    finally:
        engine.dispose()
    assert "superseded_at" not in columns and "ix_tinker_futures_current_saves" not in indexes
    assert "id" in columns
