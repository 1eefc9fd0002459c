"""A tenant's unfinished Tinker work is bounded in bytes of stored request JSON as well as in number
(`Settings.tinker_max_pending_bytes_per_tenant`): the count alone let one tenant queue 1,024 requests
of up to ~15 MB of JSON each. Past the bound a request is a 429 with Retry-After and is not stored;
the bound is read from a partial index of the unfinished futures."""

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.dialects.postgresql import asyncpg
from sqlalchemy.orm import Session

from app import migrate
from app.config import Settings
from app.db import make_engine
from app.main import create_app
from app.tinker import work
from app.tinker.models import TinkerFuture, unfinished
from tests import common
from tests.app.api import WORKER_HEADERS, TenantHandle, new_tenant, register
from tests.app.test_tinker_sampling import _base_sampler, _sample_body
from tests.app.test_tinker_work import PROTOBUF, _datum, _fwdbwd_body, _model

MIB = 1024 * 1024


def _big_body(model_id: str, seq_id: int, datums: int) -> bytes:
    """A ppo forward_backward of `datums` datums of 100 tokens: ~5.7 KB of stored JSON per datum."""
    tokens = [(7 * i) % 256 for i in range(101)]
    extra = {"logprobs": [-0.123456789] * 100, "advantages": [0.987654321] * 100}
    return _fwdbwd_body(model_id, seq_id, [_datum(tokens, **extra)] * datums, loss_fn="ppo")


def _submit(client: TestClient, body: bytes, headers: dict[str, str]) -> Any:
    return client.post("/api/v1/forward_backward", content=body, headers=headers | PROTOBUF)


def _sizes(db: Session, tenant_id: str) -> dict[int | None, int]:
    """seq_id → request_bytes of the tenant's stored futures."""
    db.expire_all()
    rows = db.execute(
        select(TinkerFuture.seq_id, TinkerFuture.request_bytes).where(
            TinkerFuture.tenant_id == tenant_id, TinkerFuture.kind != "create_model"
        )
    )
    sizes = dict(rows.tuples().all())
    db.rollback()  # end the read: on SQLite every transaction holds the write lock
    return sizes


@pytest.fixture
def capped(settings: Settings):
    """The service with the smallest byte bound the setting allows (1 MiB)."""
    with TestClient(
        create_app(settings.model_copy(update={"tinker_max_pending_bytes_per_tenant": MIB}))
    ) as c:
        yield c


def test_unfinished_request_bytes_are_bounded_per_tenant(capped: TestClient, db: Session) -> None:
    pool_id = register(capped)
    tenant, other = new_tenant(capped), new_tenant(capped)
    model_id, headers = _model(capped, tenant)
    for seq_id in (1, 2):  # ~370 KB each
        assert _submit(capped, _big_body(model_id, seq_id, 64), headers).status_code == 200
    stored = _sizes(db, tenant.id)
    assert set(stored) == {1, 2} and all(300_000 < size < 450_000 for size in stored.values()), stored

    refused = _submit(capped, _big_body(model_id, 3, 64), headers)
    assert refused.status_code == 429, refused.text
    assert refused.headers["Retry-After"] == str(work.PENDING_RETRY_AFTER_SECONDS)
    error = refused.json()["error"]
    assert error["code"] == "rate_limited", error
    assert error["details"]["kind"] == "pending_bytes"
    assert error["details"]["pending_bytes"] == sum(stored.values())
    assert error["details"]["max_pending_bytes"] == MIB
    assert sum(stored.values()) + error["details"]["request_bytes"] > MIB
    assert set(_sizes(db, tenant.id)) == {1, 2}  # nothing of it stored

    # A small request still fits; another tenant is not affected.
    assert _submit(capped, _big_body(model_id, 3, 1), headers).status_code == 200
    other_model, other_headers = _model(capped, other)
    assert _submit(capped, _big_body(other_model, 1, 64), other_headers).status_code == 200

    # Claimed (running), the requests still count; done, they no longer do.
    items = capped.post("/v1/pool/manual/claim", json={"pool_id": pool_id}, headers=WORKER_HEADERS).json()[
        "items"
    ]
    assert sorted(i["seq_id"] for i in items) == [1, 1, 2, 3]  # the other tenant's first too
    assert _submit(capped, _big_body(model_id, 4, 64), headers).status_code == 429
    results = [
        {"request_id": i["request_id"], "logprobs": [[-1.0] * 100] * len(i["data"]), "metrics": {}}
        for i in items
    ]
    recorded = capped.post(
        "/v1/pool/manual/results", json={"pool_id": pool_id, "results": results}, headers=WORKER_HEADERS
    )
    assert recorded.json() == {"recorded": len(results)}, recorded.text
    assert _submit(capped, _big_body(model_id, 4, 64), headers).status_code == 200


def test_samples_count_their_bytes_too(capped: TestClient, db: Session) -> None:
    register(capped)
    tenant = new_tenant(capped)
    model_id, headers = _model(capped, tenant)
    sampler = _base_sampler(capped, tenant)
    sample = capped.post("/api/v1/asample", json=_sample_body(sampler, [5, 6]), headers=headers)
    assert sample.status_code == 200, sample.text
    for seq_id in (1, 2):
        assert _submit(capped, _big_body(model_id, seq_id, 64), headers).status_code == 200
    stored = _sizes(db, tenant.id)
    assert stored[None] > 0  # the sample (no seq_id)
    refused = _submit(capped, _big_body(model_id, 3, 64), headers)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["details"]["pending_bytes"] == sum(stored.values())


def test_a_request_larger_than_the_bound_fits_when_nothing_waits(capped: TestClient, db: Session) -> None:
    """The bound is at least 1 MiB and a request may be larger (a round's tokens are ~15 MB of JSON):
    refusing it with an empty queue would have the SDK retry it forever."""
    register(capped)
    tenant = new_tenant(capped)
    model_id, headers = _model(capped, tenant)
    assert _submit(capped, _big_body(model_id, 1, 200), headers).status_code == 200
    assert _sizes(db, tenant.id)[1] > MIB
    assert _submit(capped, _big_body(model_id, 2, 1), headers).status_code == 429


def _stored_lengths(db: Session) -> dict[str, tuple[int, int]]:
    """id → (request_bytes, the stored request's length in bytes, measured by the database)."""
    length = (
        "octet_length(CAST(request AS TEXT))"
        if db.get_bind().dialect.name == "postgresql"
        else "length(CAST(request AS BLOB))"
    )
    db.expire_all()
    rows = db.execute(
        text(f"SELECT id, request_bytes, {length} FROM tinker_futures WHERE request IS NOT NULL")
    )
    lengths = {row[0]: (row[1], row[2]) for row in rows}
    db.rollback()  # end the read: on SQLite every transaction holds the write lock
    return lengths


def test_request_bytes_is_the_stored_json_size(client: TestClient, tenant: TenantHandle, db: Session) -> None:
    register(client)
    model_id, headers = _model(client, tenant)
    assert _submit(client, _big_body(model_id, 1, 64), headers).status_code == 200
    assert _submit(client, _fwdbwd_body(model_id, 2, [_datum([1, 2, 3])]), headers).status_code == 200
    step = {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 0.01}}
    assert client.post("/api/v1/optim_step", json=step, headers=headers).status_code == 200
    sampler = _base_sampler(client, tenant)
    assert (
        client.post("/api/v1/asample", json=_sample_body(sampler, [5, 6]), headers=headers).status_code == 200
    )
    lengths = _stored_lengths(db)
    assert len(lengths) == 4
    for estimate, actual in lengths.values():
        assert abs(estimate - actual) <= max(8, actual // 100), lengths  # within 1%


def _tenant_row(conn: Any) -> None:
    conn.execute(
        text(
            "INSERT INTO tenants (id, name, max_concurrent_runs, created_at) VALUES ('t', 't', 4, CURRENT_TIMESTAMP)"
        )
    )


def test_unfinished_requests_get_their_size_on_upgrade(tmp_path) -> None:
    """Migration 0014 adds `request_bytes`: requests stored before it and not yet done get their size
    (with 0 a full queue would read as empty, and take another gigabyte)."""
    url = (
        common.create_postgres_database()
        if common.backend_under_test() == "postgres"
        else f"sqlite:///{tmp_path / 'up.db'}"
    )
    request = json.dumps({"kind": "forward_backward", "data": [{"tokens": [1, 2, 3]}]})
    try:
        migrate.upgrade(url, "0013")
        engine = make_engine(url)
        with engine.begin() as conn:
            _tenant_row(conn)
            conn.execute(
                text(
                    "INSERT INTO tinker_futures (id, tenant_id, kind, status, request, created_at) "
                    "VALUES (:id, 't', 'forward_backward', :status, :request, CURRENT_TIMESTAMP)"
                ),
                [
                    {"id": "pending", "status": "pending", "request": request},
                    {"id": "running", "status": "running", "request": request},
                    {"id": "complete", "status": "complete", "request": request},
                    {"id": "failed", "status": "failed", "request": None},
                ],
            )
        migrate.upgrade(url)
        with engine.connect() as conn:
            sizes: dict[str, int] = dict(
                conn.execute(text("SELECT id, request_bytes FROM tinker_futures")).tuples().all()
            )
        engine.dispose()
        assert sizes == {"pending": len(request), "running": len(request), "complete": 0, "failed": 0}
    finally:
        if url.startswith("postgresql"):
            common.drop_postgres_database(url)


# --- the plan (Postgres) ---------------------------------------------------------------------------

INDEX = "ix_tinker_futures_unfinished"


@pytest.fixture
def retained_history(database_url: str):
    """A tenant with 20,000 done futures (a day of Tinker training) and 3 unfinished ones."""
    engine = create_engine(database_url)
    with engine.begin() as conn:
        _tenant_row(conn)
        conn.execute(
            text(
                "INSERT INTO tinker_futures (id, tenant_id, kind, status, request_bytes, created_at) "
                "SELECT 'f' || s, 't', 'forward_backward', "
                "CASE WHEN s > 20000 THEN 'pending' ELSE 'complete' END, 100, now() "
                "FROM generate_series(1, 20003) s"
            )
        )
        conn.execute(text("ANALYZE tinker_futures"))
    yield engine
    engine.dispose()


def _generic_plan(engine: Engine) -> str:
    """EXPLAIN of the room check as a prepared statement planned once for any tenant (psycopg prepares
    a statement run often enough)."""
    compiled = work.unfinished_query("t").compile(
        dialect=asyncpg.dialect(), compile_kwargs={"render_postcompile": True}
    )
    values = ", ".join(
        str(v) if isinstance(v, int) else f"'{v}'"
        for v in (compiled.params[n] for n in compiled.positiontup or ())
    )
    with engine.connect() as conn:
        conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
        conn.exec_driver_sql(f"PREPARE room AS {compiled}")
        return "\n".join(conn.exec_driver_sql(f"EXPLAIN EXECUTE room({values})").scalars())


@pytest.mark.postgres_only
def test_the_room_check_reads_the_unfinished_index_only(retained_history: Engine) -> None:
    plan = _generic_plan(retained_history)
    assert INDEX in plan and "Seq Scan" not in plan, plan
    with retained_history.connect() as conn:
        assert tuple(conn.execute(work.unfinished_query("t")).one()) == (3, 300)
        held = conn.execute(select(func.count()).select_from(TinkerFuture).where(text(unfinished()))).scalar()
    assert held == 3


def test_the_bound_is_read_from_the_environment_and_checked(monkeypatch, tmp_path) -> None:
    name = "LORALOOM_TINKER_MAX_PENDING_BYTES_PER_TENANT"
    assert Settings(data_dir=tmp_path).tinker_max_pending_bytes_per_tenant == 1024**3
    monkeypatch.setenv(name, str(64 * MIB))
    assert Settings(data_dir=tmp_path).tinker_max_pending_bytes_per_tenant == 64 * MIB
    monkeypatch.setenv(name, str(MIB - 1))
    with pytest.raises(ValidationError, match="tinker_max_pending_bytes_per_tenant"):
        Settings(data_dir=tmp_path)
