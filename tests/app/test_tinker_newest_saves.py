"""A checkpoint path's reads go by its newest save alone. Completed saves are never purged, so a
tenant saving under one name at every step leaves a row per step; every sample, resolve,
load_weights, weights_info and delete read all of them as whole rows (`checkpoints.live_saves`), and
the listings ranked them all in a window: 1.3 s a sample at 50,000 saves of one name
(bench/tinker_newest_saves.py). They now read the newest save of each path through the partial index
`ix_tinker_futures_current_saves` (its predicate said literally), with the same answers: checked here
with 2,000 superseded saves of each name inserted directly, on both databases, and the plans on
Postgres. A delete still marks every save of its path, in one UPDATE.
"""

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, Select, create_engine, event, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import asyncpg
from sqlalchemy.orm import ORMExecuteState, Session

from app.adapters.pruning import _live_sampler_steps
from app.db import utcnow
from app.tinker import checkpoints
from app.tinker.models import CHECKPOINT_DELETED, TinkerFuture
from tests.app.api import TenantHandle, register
from tests.app.tinker_calls import answer_work, new_model, new_session, run_of, tinker_headers

HISTORY = 2_000
"""Superseded saves of each name, inserted directly."""

MOST_ROWS = 30
"""The rows a call may fetch, all its statements together (load_weights, which makes a model and a run,
fetches 15; the older saves are 2,000 a name)."""

STATE, SAMPLER = "save_weights", "save_weights_for_sampler"

SAVED_PATH = re.compile(r"tinker_futures\.result ->>|JSON_EXTRACT\(tinker_futures\.result", re.IGNORECASE)
"""A key of a future's result, read in SQL (Postgres, SQLite)."""


@dataclass
class Saved:
    model_id: str
    run_id: str
    pool_id: str
    sampler: str
    """tinker://<model>/sampler_weights/s: its newest save names step 1, its older ones 1001..."""
    state: str
    """tinker://<model>/weights/w."""


def _save(client: TestClient, tenant: TenantHandle, model_id: str, seq_id: int, kind: str, name: str) -> None:
    body = {"model_id": model_id, "seq_id": seq_id, "path": name}
    r = client.post(f"/api/v1/{kind}", json=body, headers=tinker_headers(tenant))
    assert r.status_code == 200, r.text


def _insert_history(db: Session, model_id: str) -> None:
    """`HISTORY` older saves of the newest save of each of the model's paths: lower seq ids, earlier
    completions, superseded (as `record_results` marks them), the sampler's naming other steps."""
    db.expire_all()
    rows: list[dict[str, Any]] = []
    newest_saves = select(TinkerFuture).where(
        TinkerFuture.model_id == model_id,
        TinkerFuture.kind.in_((STATE, SAMPLER)),
        TinkerFuture.status == "complete",
        TinkerFuture.superseded_at.is_(None),
    )
    for newest in db.scalars(newest_saves):
        assert newest.seq_id is not None and newest.result is not None and newest.completed_at is not None
        for g in range(1, HISTORY + 1):
            result = dict(newest.result)
            if newest.kind == SAMPLER:
                result["loraloom_step"] = 1000 + g
            rows.append(
                {
                    "id": f"{newest.id}-{g}",
                    "tenant_id": newest.tenant_id,
                    "kind": newest.kind,
                    "model_id": model_id,
                    "run_id": newest.run_id,
                    "seq_id": -(newest.seq_id * 100_000 + g),
                    "status": "complete",
                    "result": result,
                    "created_at": newest.created_at - timedelta(seconds=g),
                    "completed_at": newest.completed_at - timedelta(seconds=g),
                    "superseded_at": utcnow(),
                }
            )
    db.execute(insert(TinkerFuture), rows)
    if db.get_bind().dialect.name == "postgresql":
        db.execute(text("ANALYZE tinker_futures"))
    db.commit()


@pytest.fixture
def saved(client: TestClient, tenant: TenantHandle, db: Session) -> Saved:
    """A model whose sampler checkpoint `s` and training state `w` were each saved once through the
    API (`s` twice: a real supersede too) and `HISTORY` times before that."""
    pool_id = register(client)
    model_id = new_model(client, tenant)
    _save(client, tenant, model_id, 1, SAMPLER, "s")
    _save(client, tenant, model_id, 2, STATE, "w")
    _save(client, tenant, model_id, 3, SAMPLER, "s")
    assert len(answer_work(client, pool_id)) == 3
    _insert_history(db, model_id)
    return Saved(
        model_id=model_id,
        run_id=run_of(client, tenant, model_id),
        pool_id=pool_id,
        sampler=f"tinker://{model_id}/sampler_weights/s",
        state=f"tinker://{model_id}/weights/w",
    )


@dataclass
class Reads:
    """What the app's sessions fetched (rows of every statement that returns rows) and the SQL sent,
    whichever engine and session sent it (listeners on the classes: the app's own sessions too)."""

    rows: int = 0
    statements: list[str] = field(default_factory=list)

    def saves_read(self) -> list[str]:
        """The queries that read saves by what their results name (the path, the deleted mark)."""
        return [s for s in self.statements if s.lstrip().startswith("SELECT") and SAVED_PATH.search(s)]


@pytest.fixture
def reads() -> Iterator[Callable[[Callable[[], Any]], Reads]]:
    def counting(call: Callable[[], Any]) -> Reads:
        seen = Reads()

        def fetched(state: ORMExecuteState) -> Any:
            if not state.is_select:
                return None
            frozen = state.invoke_statement().freeze()
            seen.rows += len(frozen.data)
            return frozen()

        def sent(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
            seen.statements.append(statement)

        event.listen(Session, "do_orm_execute", fetched)
        event.listen(Engine, "before_cursor_execute", sent)
        try:
            call()
        finally:
            event.remove(Engine, "before_cursor_execute", sent)
            event.remove(Session, "do_orm_execute", fetched)
        return seen

    yield counting


def _reads_newest_saves_alone(seen: Reads) -> None:
    assert seen.rows <= MOST_ROWS, seen.rows
    assert seen.saves_read(), seen.statements  # the check below checked something
    for statement in seen.saves_read():
        assert "superseded_at IS NULL" in statement, statement


def test_every_call_on_a_path_fetches_its_newest_save_alone(
    client: TestClient, tenant: TenantHandle, saved: Saved, reads: Callable[[Callable[[], Any]], Reads]
) -> None:
    """Resolve, a sampling client's creation and every sample, weights_info and load_weights answer
    from the path's newest save (step 1, not an older save's 1001...), fetching a handful of rows
    where they fetched the 2,000 older saves; each statement that reads saves says the index's
    predicate."""
    headers = tinker_headers(tenant)
    answers: dict[str, Any] = {}

    def call(name: str, method: str, url: str, **kwargs: Any) -> None:
        def send() -> None:
            answers[name] = client.request(method, url, headers=headers, **kwargs)

        _reads_newest_saves_alone(reads(send))
        assert answers[name].status_code == 200, answers[name].text

    call("resolve", "GET", "/api/v1/loraloom/resolve", params={"path": saved.sampler})
    assert answers["resolve"].json() == {
        "run_id": saved.run_id,
        "step": 1,
        "adapter_url": f"/v1/runs/{saved.run_id}/adapters/1",
    }
    call("open", "POST", "/api/v1/create_sampling_session", json={"model_path": saved.sampler})
    sampler_id = answers["open"].json()["sampling_session_id"]
    call("sampler", "GET", f"/api/v1/samplers/{sampler_id}")
    sample = {
        "sampling_session_id": sampler_id,
        "prompt": {"chunks": [{"tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2},
    }
    call("sample", "POST", "/api/v1/asample", json=sample)
    (item,) = answer_work(client, saved.pool_id)
    assert item["kind"] == "sample" and item["sampling"]["step"] == 1
    call("info", "POST", "/api/v1/weights_info", json={"tinker_path": saved.state})
    assert answers["info"].json()["lora_rank"] == 4
    load = {
        "path": saved.state,
        "session_id": new_session(client, tenant),
        "model_seq_id": 0,
        "optimizer": True,
    }
    call("load", "POST", "/api/v1/load_weights", json=load)


def test_the_listings_rank_the_newest_saves_alone(
    client: TestClient,
    tenant: TenantHandle,
    saved: Saved,
    reads: Callable[[Callable[[], Any]], Reads],
    db: Session,
) -> None:
    """The model's checkpoints, the tenant's, and a training run's latest ones: each path once, at
    its newest save's time, read from the newest saves (the window ranked all 2,000 of each)."""
    headers = tinker_headers(tenant)
    newest = {
        str((f.result or {})["path"]): f.completed_at
        for f in db.scalars(
            select(TinkerFuture).where(
                TinkerFuture.model_id == saved.model_id, TinkerFuture.seq_id.in_((2, 3))
            )
        )
    }
    db.rollback()
    got: dict[str, Any] = {}

    def listed(name: str, url: str) -> None:
        def send() -> None:
            got[name] = client.get(url, headers=headers)

        _reads_newest_saves_alone(reads(send))
        assert got[name].status_code == 200, got[name].text

    listed("model", f"/api/v1/training_runs/{saved.model_id}/checkpoints")
    listed("tenant", "/api/v1/checkpoints")
    listed("run", f"/api/v1/training_runs/{saved.model_id}")
    listed("runs", "/api/v1/training_runs")
    for name in ("model", "tenant"):
        checkpoints_listed = got[name].json()["checkpoints"]
        assert [c["tinker_path"] for c in checkpoints_listed] == [saved.sampler, saved.state]
        for c in checkpoints_listed:
            at = newest[c["tinker_path"]]
            assert at is not None and c["time"] == at.isoformat()
    assert got["tenant"].json()["cursor"]["total_count"] == 2
    (run,) = got["runs"].json()["training_runs"]
    assert run == got["run"].json()
    assert run["last_checkpoint"]["tinker_path"] == saved.state
    assert run["last_sampler_checkpoint"]["tinker_path"] == saved.sampler


def _deleted_saves(db: Session, path: str) -> tuple[int, int]:
    """(saves of `path` marked deleted, saves of it not)."""
    db.expire_all()
    marked = TinkerFuture.result[CHECKPOINT_DELETED].as_string().is_not(None)
    rows = db.execute(
        select(marked, func.count()).where(checkpoints.saved_path() == path).group_by(marked)
    ).all()
    db.rollback()
    counts = {bool(is_marked): int(n) for is_marked, n in rows}
    return counts.get(True, 0), counts.get(False, 0)


def _pinned(db: Session, run_id: str) -> list[tuple[str | None, int | None]]:
    """The (run, step) pairs the pruning keeps for the run's live sampler checkpoints."""
    pinned = [(run, step) for run, step in db.execute(_live_sampler_steps([run_id]))]
    db.rollback()
    return pinned


def test_a_delete_marks_every_save_of_its_path_in_one_statement(
    client: TestClient,
    tenant: TenantHandle,
    saved: Saved,
    reads: Callable[[Callable[[], Any]], Reads],
    db: Session,
) -> None:
    """Deleting a checkpoint marks every save of its path, the superseded ones too (a deleted
    path must have no live save left for the newest-save reads and the pruning's pins): one UPDATE,
    no row of the history fetched. Saved again, the name is live with the new save alone."""
    headers = tinker_headers(tenant)
    assert _pinned(db, saved.run_id) == [(saved.run_id, 1)]
    url = f"/api/v1/training_runs/{saved.model_id}/checkpoints/sampler_weights/s"
    deleted: list[Any] = []
    seen = reads(lambda: deleted.append(client.delete(url, headers=headers)))
    assert deleted[0].status_code == 204, deleted[0].text
    assert seen.rows <= MOST_ROWS, seen.rows
    writes = [s for s in seen.statements if s.lstrip().upper().startswith("UPDATE TINKER_FUTURES")]
    assert len(writes) == 1, seen.statements
    assert _deleted_saves(db, saved.sampler) == (HISTORY + 2, 0)
    assert _pinned(db, saved.run_id) == []  # no older save left to pin its step
    assert _deleted_saves(db, saved.state) == (0, HISTORY + 1)  # another path's saves untouched
    resolved = client.get("/api/v1/loraloom/resolve", params={"path": saved.sampler}, headers=headers)
    assert resolved.status_code == 404, resolved.text
    listed = client.get(f"/api/v1/training_runs/{saved.model_id}/checkpoints", headers=headers).json()
    assert [c["tinker_path"] for c in listed["checkpoints"]] == [saved.state]
    assert client.delete(url, headers=headers).status_code == 404

    _save(client, tenant, saved.model_id, 4, SAMPLER, "s")
    answer_work(client, saved.pool_id)
    resolved = client.get("/api/v1/loraloom/resolve", params={"path": saved.sampler}, headers=headers)
    assert resolved.status_code == 200 and resolved.json()["step"] == 1, resolved.text
    assert _pinned(db, saved.run_id) == [(saved.run_id, 1)]
    listed = client.get(f"/api/v1/training_runs/{saved.model_id}/checkpoints", headers=headers).json()
    assert [c["tinker_path"] for c in listed["checkpoints"]] == [saved.sampler, saved.state]


def test_an_older_save_left_unmarked_ranks_below_the_newest(
    client: TestClient, tenant: TenantHandle, saved: Saved, db: Session
) -> None:
    """A save recorded by a process from before migration 0021 leaves its path's older save
    unmarked: the path still resolves to its newest save, lists once, and a delete forgets both."""
    db.execute(
        update(TinkerFuture)
        .where(TinkerFuture.model_id == saved.model_id, TinkerFuture.seq_id.in_((-300_001, -200_001)))
        .values(superseded_at=None)
    )
    db.commit()
    headers = tinker_headers(tenant)
    resolved = client.get("/api/v1/loraloom/resolve", params={"path": saved.sampler}, headers=headers)
    assert resolved.status_code == 200 and resolved.json()["step"] == 1, resolved.text
    info = client.post("/api/v1/weights_info", json={"tinker_path": saved.state}, headers=headers)
    assert info.status_code == 200, info.text
    listed = client.get("/api/v1/checkpoints", headers=headers).json()
    assert [c["tinker_path"] for c in listed["checkpoints"]] == [saved.sampler, saved.state]
    assert listed["cursor"]["total_count"] == 2
    url = f"/api/v1/training_runs/{saved.model_id}/checkpoints/sampler_weights/s"
    assert client.delete(url, headers=headers).status_code == 204
    resolved = client.get("/api/v1/loraloom/resolve", params={"path": saved.sampler}, headers=headers)
    assert resolved.status_code == 404, resolved.text
    listed = client.get("/api/v1/checkpoints", headers=headers).json()
    assert [c["tinker_path"] for c in listed["checkpoints"]] == [saved.state]


def _plans(engine: Engine, query: Select[Any]) -> tuple[str, str]:
    """`query`'s plan with its values, and its generic plan (what psycopg's prepared statement gets
    once it has run a few times: the values are parameters the planner cannot look into)."""
    with engine.connect() as conn:
        sql = str(query.compile(engine, compile_kwargs={"literal_binds": True}))
        custom = "\n".join(conn.exec_driver_sql(f"EXPLAIN {sql}").scalars())
        compiled = query.compile(dialect=asyncpg.dialect(), compile_kwargs={"render_postcompile": True})
        values = ", ".join(
            "'" + str(compiled.params[name]).replace("'", "''") + "'" for name in compiled.positiontup or ()
        )
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE q AS {compiled}")
        generic = "\n".join(conn.exec_driver_sql(f"EXPLAIN EXECUTE q({values})").scalars())
        conn.exec_driver_sql("DEALLOCATE q")  # the connection goes back to the pool
    return custom, generic


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = create_engine(database_url)
    yield engine
    engine.dispose()


@pytest.mark.postgres_only
def test_the_reads_of_paths_use_the_newest_saves_index(
    saved: Saved, tenant: TenantHandle, engine: Engine
) -> None:
    """Postgres reads the saves of each call above through `ix_tinker_futures_current_saves` (the
    newest of each path), never the whole table, in a generic plan too."""
    queries = {
        "resolve": checkpoints.newest_save_query(
            tenant.id, model_id=saved.model_id, kind=SAMPLER, path=saved.sampler
        ),
        "load_weights": checkpoints.newest_save_query(
            tenant.id, model_id=saved.model_id, kind=STATE, path=saved.state
        ),
        "model's checkpoints": checkpoints.page_query(tenant.id, model_id=saved.model_id),
        "tenant's checkpoints": checkpoints.page_query(tenant.id, limit=100, offset=0),
        "tenant's checkpoints, page 2": checkpoints.page_query(tenant.id, limit=1, offset=1),
        "latest": checkpoints.latest_query(tenant.id, model_ids=[saved.model_id]),
    }
    for name, query in queries.items():
        for plan in _plans(engine, query):
            assert "ix_tinker_futures_current_saves" in plan, (name, plan)
            assert "Seq Scan on tinker_futures" not in plan, (name, plan)
