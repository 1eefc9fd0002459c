"""Live sampler checkpoints are bounded per tenant (`tinker_max_sampler_checkpoints_per_tenant`):
every `save_weights_for_sampler` under a new name pinned its adapter step from the pruning and kept
a copy on the pool's disk, with no limit, so a tenant saving in a loop pinned steps without end.
Past the bound a save is the 403 `save_quota` of saved training states (the official SDK retries a
409 or 429 of a submission for 5 minutes: tests/app/test_tinker_retry_hints.py), naming the bound
and how to free a place, and nothing is stored. Deleting a sampler checkpoint frees its place.
"""

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, event, func, select, text
from sqlalchemy.dialects.postgresql import asyncpg
from sqlalchemy.orm import Session

from app.config import Settings
from app.main import create_app
from app.tinker import checkpoints
from app.tinker.models import TinkerFuture
from tests.app.api import LiveServer, TenantHandle, new_tenant, register
from tests.app.tinker_calls import AnsweringPool, answer_work, new_model, run_of, tinker_headers
from tests.common import wait_for_a_lock_waiter

MOST = 3
SETTING = "LORALOOM_TINKER_MAX_SAMPLER_CHECKPOINTS_PER_TENANT"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"tinker_max_sampler_checkpoints_per_tenant": MOST})


def _save(
    http: Any,
    model_id: str,
    tenant: TenantHandle,
    seq_id: int,
    name: str,
    kind: str = "save_weights_for_sampler",
) -> Any:
    body = {"model_id": model_id, "seq_id": seq_id, "path": name}
    return http.post(f"/api/v1/{kind}", json=body, headers=tinker_headers(tenant))


def _sampler_saves(db: Session) -> int:
    db.expire_all()
    saves = (
        select(func.count()).select_from(TinkerFuture).where(TinkerFuture.kind == "save_weights_for_sampler")
    )
    n = int(db.scalar(saves) or 0)
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return n


def _refused(r: Any, kept: int) -> None:
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "save_quota"
    assert error["details"] == {"kind": "sampler_checkpoints", "kept": kept, "limit": MOST}
    assert f"{SETTING} = {MOST}" in error["message"]
    assert "delete one to free its place" in error["message"]


def test_a_tenant_keeps_at_most_its_live_sampler_checkpoints(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    pool_id = register(client)
    model_id = new_model(client, tenant)
    for seq_id, name in enumerate(["s0", "s1"], start=1):
        assert _save(client, model_id, tenant, seq_id, name).status_code == 200
    assert len(answer_work(client, pool_id)) == 2
    # One more pending (not yet run by the pool): it counts, as it will be live once run.
    assert _save(client, model_id, tenant, 3, "s2").status_code == 200

    _refused(_save(client, model_id, tenant, 4, "s3"), kept=MOST)
    assert _sampler_saves(db) == MOST  # nothing stored

    # A live name saved again replaces it (its path names the newest save only): always room.
    assert _save(client, model_id, tenant, 4, "s0").status_code == 200
    # Training states are not sampler checkpoints: their own quota.
    assert _save(client, model_id, tenant, 5, "st", kind="save_weights").status_code == 200
    # Another tenant has its own bound.
    other = new_tenant(client)
    assert _save(client, new_model(client, other), other, 1, "s3").status_code == 200
    answer_work(client, pool_id)

    # Deleting a sampler checkpoint (the Tinker delete route) frees its place.
    gone = client.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/s1", headers=tinker_headers(tenant)
    )
    assert gone.status_code == 204, gone.text
    assert _save(client, model_id, tenant, 6, "s3").status_code == 200
    _refused(_save(client, model_id, tenant, 7, "s4"), kept=MOST)


def test_a_deleted_runs_sampler_checkpoints_do_not_count(client: TestClient, tenant: TenantHandle) -> None:
    pool_id = register(client)
    model_id = new_model(client, tenant)
    for seq_id in range(1, MOST + 1):
        assert _save(client, model_id, tenant, seq_id, f"s{seq_id}").status_code == 200
    answer_work(client, pool_id)
    _refused(_save(client, model_id, tenant, MOST + 1, "new"), kept=MOST)
    assert (
        client.delete(f"/v1/runs/{run_of(client, tenant, model_id)}", headers=tenant.headers).status_code
        == 200
    )
    fresh = new_model(client, tenant)
    assert _save(client, fresh, tenant, 1, "s1").status_code == 200


@pytest.fixture
def one_place(settings: Settings) -> Iterator[tuple[LiveServer, httpx.Client]]:
    """The app under uvicorn with a bound of one live sampler checkpoint."""
    app = create_app(settings.model_copy(update={"tinker_max_sampler_checkpoints_per_tenant": 1}))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        yield server, http


def test_past_the_bound_the_sdk_raises_at_once_and_a_deletion_makes_room(
    one_place: tuple[LiveServer, httpx.Client], db: Session
) -> None:
    server, http = one_place
    tenant = new_tenant(http)
    pool_id = register(http)
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + tenant.key)
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + tenant.key)
    try:
        with AnsweringPool(server.url, pool_id):
            training = service.create_lora_training_client(
                "loraloom-tiny", rank=4, train_mlp=False, train_unembed=False
            ).result()
            first = training.save_weights_for_sampler("first").result(timeout=30)
            with pytest.raises(tinker.PermissionDeniedError) as refused:
                training.save_weights_for_sampler("second").result(timeout=15)
            assert _sampler_saves(db) == 1  # nothing stored

            rest.delete_checkpoint_from_tinker_path(first.path).result()
            second = training.save_weights_for_sampler("second").result(timeout=30)
    finally:
        service.close("success").result()
    assert refused.value.status_code == 403
    assert f"{SETTING} = 1" in str(refused.value)
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["code"] == "save_quota"
    assert second.path == f"tinker://{training.model_id}/sampler_weights/second"
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [second.path]


@pytest.mark.postgres_only
def test_two_saves_at_once_cannot_both_take_the_last_place(
    one_place: tuple[LiveServer, httpx.Client], db: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save counts under the tenant's row lock and holds it to its commit; the second,
    sent meanwhile, waits for that lock, then counts the first's save. The window is held open: the
    first pauses after its count, until the second is seen waiting for a lock. Without the lock both
    counted none and both were stored."""
    _, http = one_place
    tenant = new_tenant(http)
    model_id = new_model(http, tenant)
    real = checkpoints.check_sampler_quota
    counted, go = threading.Event(), threading.Event()
    calls: list[str] = []

    def pause_after_the_first_count(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        calls.append(kwargs["path"])
        if len(calls) == 1:
            counted.set()
            assert go.wait(30)

    monkeypatch.setattr(checkpoints, "check_sampler_quota", pause_after_the_first_count)
    answers: dict[str, httpx.Response] = {}

    def save(seq_id: int, name: str) -> None:
        answers[name] = _save(http, model_id, tenant, seq_id, name)

    first = threading.Thread(target=save, args=(1, "a"))
    second = threading.Thread(target=save, args=(2, "b"))
    first.start()
    assert counted.wait(30)
    second.start()
    try:
        wait_for_a_lock_waiter(db, "the second save (the tenant's row)")
    finally:
        go.set()
        first.join(30)
        second.join(30)
    assert answers["a"].status_code == 200, answers["a"].text
    assert answers["b"].status_code == 403, answers["b"].text
    assert answers["b"].json()["error"]["details"] == {"kind": "sampler_checkpoints", "kept": 1, "limit": 1}
    assert _sampler_saves(db) == 1


def _code(r: Any) -> str:
    code: str = r.json()["error"]["code"]
    return code


@pytest.mark.parametrize("leaves_by", ["evict", "delete"])
def test_at_the_bound_a_save_to_a_model_whose_run_left_is_refused_for_that(
    client: TestClient, tenant: TenantHandle, db: Session, leaves_by: str
) -> None:
    """The run's status is checked before the quota: a save to a model whose run left answers 400
    `run_not_active` (it was the 403 `save_quota`, whose "delete one" would not have let it save),
    while a save to a model whose run is active still gets the 403."""
    full = new_model(client, tenant)
    for seq_id in range(1, MOST + 1):
        assert _save(client, full, tenant, seq_id, f"s{seq_id}").status_code == 200
    gone = new_model(client, tenant)
    run_id = run_of(client, tenant, gone)
    if leaves_by == "evict":
        left = client.post(f"/v1/runs/{run_id}/evict", json={"reason": "done here"}, headers=tenant.headers)
    else:
        left = client.delete(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert left.status_code == 200, left.text

    refused = _save(client, gone, tenant, 1, "new")
    assert refused.status_code == 400 and _code(refused) == "run_not_active", refused.text
    assert run_id in refused.json()["error"]["message"]
    _refused(_save(client, full, tenant, MOST + 1, "new"), kept=MOST)
    assert _sampler_saves(db) == MOST  # nothing stored


def _statements_of(db: Session, call: Any) -> list[str]:
    """The SQL statements `call()` sends through `db`'s connection."""
    seen: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append(statement)

    engine = db.get_bind()
    event.listen(engine, "before_cursor_execute", record)
    try:
        call()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return seen


def _current(db: Session, model_id: str) -> list[tuple[int, str]]:
    """(seq_id, path) of the model's saves no newer save of their path superseded."""
    db.expire_all()
    rows = db.execute(
        select(TinkerFuture.seq_id, TinkerFuture.result)
        .where(TinkerFuture.model_id == model_id, TinkerFuture.superseded_at.is_(None))
        .where(TinkerFuture.status == "complete", TinkerFuture.kind == "save_weights_for_sampler")
        .order_by(TinkerFuture.seq_id)
    ).all()
    db.rollback()
    return [(int(seq_id or 0), str((result or {})["path"])) for seq_id, result in rows]


def test_the_quota_counts_paths_by_their_newest_saves_in_one_aggregate_row(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    """Completed saves are never purged: a tenant saving under one name at every step leaves a row
    per step, which the quota counted on every save under the tenant's lock (207 ms at 50,000 saves
    of one name). A save's older saves of its path are marked superseded when it completes (two in
    one post of the pool's results too), and the count is one aggregate statement over the newest
    of each path and the unfinished saves (its plan on Postgres: `test_the_quota_reads_...` below)."""
    pool_id = register(client)
    model_id = new_model(client, tenant)
    path = f"tinker://{model_id}/sampler_weights/"
    for seq_id, name in enumerate(["a", "a", "c"], start=1):  # answered in one post
        assert _save(client, model_id, tenant, seq_id, name).status_code == 200
    assert len(answer_work(client, pool_id)) == 3
    assert _save(client, model_id, tenant, 4, "a").status_code == 200
    assert len(answer_work(client, pool_id)) == 1
    assert _save(client, model_id, tenant, 5, "b").status_code == 200  # left pending
    c_gone = client.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/c", headers=tinker_headers(tenant)
    )
    assert c_gone.status_code == 204, c_gone.text
    assert _current(db, model_id) == [(3, path + "c"), (4, path + "a")]

    def check(name: str, most: int) -> int | None:
        """The `kept` the quota refuses a save of `name` with; None when it takes it."""
        try:
            checkpoints.check_sampler_quota(db, tenant_id=tenant.id, path=path + name, most=most)
        except checkpoints.SaveQuota as refused:
            return int(refused.details["kept"])
        finally:
            db.rollback()  # the tenant's row lock
        return None

    # Live: a (its newest save) and b (pending; its path built in SQL from the request's name);
    # c is deleted. A live name is always taken, a new one or the deleted one only below the bound.
    assert [check(name, most=2) for name in ("a", "b", "c", "d")] == [None, None, 2, 2]
    assert check("d", most=3) is None
    statements = _statements_of(db, lambda: check("d", most=2))
    counts = [s for s in statements if "tinker_futures" in s]
    assert len(counts) == 1 and counts[0].lstrip().startswith("SELECT count(DISTINCT"), statements
    assert "GROUP BY" not in counts[0]  # an aggregate of the whole: one row back


@pytest.fixture
def many_superseded_saves(client: TestClient, tenant: TenantHandle, database_url: str) -> Iterator[Engine]:
    """A tenant's model with a live sampler checkpoint and a training state saved 5,000 times each
    before (the older saves superseded, as `record_results` marks them), and the table analyzed."""
    pool_id = register(client)
    model_id = new_model(client, tenant)
    assert _save(client, model_id, tenant, 1, "a").status_code == 200
    assert _save(client, model_id, tenant, 2, "a", kind="save_weights").status_code == 200
    answer_work(client, pool_id)
    engine = create_engine(database_url)
    columns = (
        "tenant_id, kind, model_id, run_id, status, lost_leases, tokens, request_bytes, result, created_at"
    )
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO tinker_futures (id, seq_id, completed_at, superseded_at, {columns}) "
                f"SELECT f.id || '-' || g, f.seq_id * 100000 + g, f.completed_at - g * interval '1 second', now(), {columns} "
                "FROM tinker_futures f, generate_series(1, 5000) g WHERE f.kind LIKE 'save_weights%'"
            )
        )
        conn.execute(text("ANALYZE tinker_futures"))
    yield engine
    engine.dispose()


def _plan(engine: Engine, sql: str) -> str:
    with engine.connect() as conn:
        return "\n".join(conn.exec_driver_sql(f"EXPLAIN {sql}").scalars())


@pytest.mark.postgres_only
@pytest.mark.parametrize("kind", ["save_weights_for_sampler", "save_weights"])
def test_the_quota_reads_the_newest_saves_index(
    many_superseded_saves: Engine, tenant: TenantHandle, kind: str
) -> None:
    """The completed saves are read through `ix_tinker_futures_current_saves` (each path's newest
    save), not the 10,000 superseded ones, in a generic plan too (psycopg prepares a statement run
    often enough: the index's predicate is said literally, which a generic plan can see)."""
    engine = many_superseded_saves
    query = checkpoints.kept_query(
        tenant.id, kind=kind, path="tinker://m/x/y", deleted_kept=kind == "save_weights"
    )
    got = _plan(engine, str(query.compile(engine, compile_kwargs={"literal_binds": True})))
    assert "ix_tinker_futures_current_saves" in got and "Seq Scan on tinker_futures" not in got, got

    compiled = query.compile(dialect=asyncpg.dialect(), compile_kwargs={"render_postcompile": True})
    values = ", ".join(
        "'" + str(compiled.params[name]).replace("'", "''") + "'" for name in compiled.positiontup or ()
    )
    with engine.connect() as conn:
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE kept_q AS {compiled}")
        generic = "\n".join(conn.exec_driver_sql(f"EXPLAIN EXECUTE kept_q({values})").scalars())
        kept = conn.execute(query).one()
    assert "ix_tinker_futures_current_saves" in generic and "Seq Scan on tinker_futures" not in generic, (
        generic
    )
    assert tuple(kept) == (1, 0)
