"""Migration 0022: the newest live save of each checkpoint path is current again where 0021's backfill
marked it superseded. 0021 ranked a path's deleted saves too: a path whose newest save (by request
number) was deleted, and whose older save completed after that delete (results posted out of
request order), named the older save until then, and the app names it so today
(tests/app/test_tinker_save_order.py); 0021 left it superseded beside the deleted one, so the path
stopped resolving and the pruning stopped keeping its adapter. Rows written at 0020, upgraded
through Alembic on the backend under test; the pruning's pins (app/adapters/pruning.py, which read
the newest saves the way a path's reads do) show what each revision names."""

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from app import migrate
from app.adapters.pruning import _live_sampler_steps
from app.db import make_engine
from tests.app.migration_db import empty_database, insert_tenant

SAMPLER, STATE = "save_weights_for_sampler", "save_weights"
SEGMENT = {SAMPLER: "sampler_weights", STATE: "weights"}
RUN = "run_m1"


@pytest.fixture
def url_at_0020(tmp_path: Path) -> Iterator[str]:
    with empty_database(tmp_path) as url:
        migrate.upgrade(url, "0020")
        yield url


def _save(
    id: str,
    seq: int,
    *,
    name: str,
    second: int | None,
    deleted: bool = False,
    kind: str = SAMPLER,
    model: str = "m1",
    status: str = "complete",
) -> dict[str, Any]:
    """A save of the schema of 0020, completed at `second`: tinker://<model>/.../<name>, a sampler
    save naming the adapter of step 10 x `seq`, marked deleted if `deleted`."""
    result: dict[str, Any] = {"path": f"tinker://{model}/{SEGMENT[kind]}/{name}", "type": kind}
    if kind == SAMPLER:
        result["loraloom_step"] = 10 * seq
    if deleted:
        result["loraloom_deleted"] = True
    return {
        "id": id,
        "kind": kind,
        "model": model,
        "run": RUN if model == "m1" else "run_m2",
        "seq": seq,
        "status": status,
        "result": json.dumps(result) if status == "complete" else None,
        "at": None if second is None else datetime(2026, 1, 1, 0, 0, second, tzinfo=UTC),
    }


FUTURES = [
    # "d": seq 7 completed and was deleted; then seqs 5 and 4 completed (out of order), live. The
    # path names seq 5, the highest live one.
    _save("d7", 7, name="d", second=1, deleted=True),
    _save("d5", 5, name="d", second=3),
    _save("d4", 4, name="d", second=4),
    # A training state the same way: seq 9 deleted, seq 8 completed after.
    _save("w9", 9, name="w", second=1, deleted=True, kind=STATE),
    _save("w8", 8, name="w", second=2, kind=STATE),
    # Every save deleted: the path stays gone.
    _save("g2", 12, name="g", second=1, deleted=True),
    _save("g1", 11, name="g", second=2, deleted=True),
    # Deleted, then saved again by a newer request: the newer names it (0021 was right).
    _save("r1", 21, name="r", second=1, deleted=True),
    _save("r2", 22, name="r", second=5),
    # Nothing deleted (0021 was right).
    _save("n1", 31, name="n", second=1),
    _save("n2", 32, name="n", second=2),
    # Another model's path of the same name, alone.
    _save("o1", 1, name="d", second=1, model="m2"),
    # A pending save, a save without a completion time: left alone.
    _save("p1", 40, name="d", second=None, status="pending"),
    _save("t1", 41, name="d", second=None),
]


def _superseded(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id FROM tinker_futures WHERE superseded_at IS NOT NULL ORDER BY id"))
        return list(rows.scalars())


def _pinned(engine: Engine) -> set[tuple[str | None, int | None]]:
    """The (run, step) the pruning keeps for m1's live sampler checkpoints."""
    with Session(engine) as session:
        return {(run, step) for run, step in session.execute(_live_sampler_steps([RUN]))}


def test_the_newest_live_save_of_a_path_whose_newest_save_was_deleted_is_current_again(
    url_at_0020: str,
) -> None:
    url = url_at_0020
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            insert_tenant(conn)
            conn.execute(
                text(
                    "INSERT INTO tinker_futures (id, tenant_id, kind, model_id, run_id, seq_id, status, "
                    "result, created_at, completed_at) VALUES (:id, 't', :kind, :model, :run, :seq, "
                    ":status, :result, CURRENT_TIMESTAMP, :at)"
                ),
                FUTURES,
            )
        migrate.upgrade(url, "0021")
        # 0021's ranking: the deleted d7 and w9 current, the live d5 and w8 superseded.
        assert _superseded(engine) == ["d4", "d5", "g1", "n1", "r1", "w8"]
        assert _pinned(engine) == {(RUN, 220), (RUN, 320)}  # "d" named nothing: step 50 unkept

        migrate.upgrade(url, "0022")
        assert _superseded(engine) == ["d4", "g1", "n1", "r1"]
        assert _pinned(engine) == {(RUN, 50), (RUN, 220), (RUN, 320)}

        # Data only: the downgrade leaves the rows, and upgrading again changes nothing.
        migrate.downgrade(url, "0021")
        assert _superseded(engine) == ["d4", "g1", "n1", "r1"]
        migrate.upgrade(url, "0022")
        assert _superseded(engine) == ["d4", "g1", "n1", "r1"]
    finally:
        engine.dispose()
