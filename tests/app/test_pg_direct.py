"""The ingestion hot path's statements on the psycopg connection (app/db.py pg_execute) fail as
they did through SQLAlchemy: the same exception classes, the connection invalidated on a
disconnect, and through the app the same answer (a lock wait cut short by the database is the 503
`database_unavailable` with Retry-After), with nothing stored."""

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy import exc as sa_exc

from app.db import make_engine, pg_execute
from app.error_guard import is_database_unavailable
from app.key_cache import ApiKeyCache
from app.main import create_app
from tests.app.api import batch_body, post_batch
from tests.app.factories import batch_count, rollout_files, seed_run
from tests.common import PG_ADMIN_URL

pytestmark = pytest.mark.postgres_only


def test_driver_errors_are_sqlalchemy_s(settings):
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn, pytest.raises(sa_exc.DataError):  # the error guard's 422
            pg_execute(conn, text("SELECT 1 / :zero"), {"zero": 0})
        with engine.connect() as conn, engine.connect() as killer:
            row = pg_execute(conn, text("SELECT pg_backend_pid()"), {})
            assert row is not None
            killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": row[0]})
            with pytest.raises(sa_exc.OperationalError) as raised:
                pg_execute(conn, text("SELECT 1"), {})
            assert raised.value.connection_invalidated and is_database_unavailable(raised.value)
            assert conn.invalidated  # the pool will not hand this connection out again
    finally:
        engine.dispose()


def test_a_database_error_on_the_hot_path_is_the_uniform_503_and_stores_nothing(settings, fast_calls):
    seeded = seed_run(settings)
    name = settings.database_url.rsplit("/", 1)[1]
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:  # the app's connections (opened below) wait 0.2 s for a lock at most
        conn.execute(text(f"ALTER DATABASE \"{name}\" SET lock_timeout = '200ms'"))
    try:
        app = create_app(settings)
        app.state.api_key_cache = ApiKeyCache(60.0)
        with TestClient(app) as client:
            assert post_batch(client, seeded, batch_body(2, seed=1), key="a").status_code == 201  # caches
            holder = make_engine(settings.database_url)
            with holder.connect() as lock:
                # Another transaction holds the run row: the reserve-and-insert statement waits for it.
                lock.execute(text("SELECT 1 FROM runs WHERE id = :id FOR UPDATE"), {"id": seeded.run_id})
                r = post_batch(client, seeded, batch_body(2, seed=2), msgpack=True, key="b")
                lock.rollback()
            holder.dispose()
            assert fast_calls == [seeded.run_id]  # the fast path (psycopg directly) answered it
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "database_unavailable"
            assert int(r.headers["retry-after"]) > 0
            assert r.headers["content-type"] == "application/json"
            assert batch_count(settings) == 1 and len(rollout_files(settings)) == 1
            # The connection went back to the pool usable: the retry is stored once.
            assert post_batch(client, seeded, batch_body(2, seed=2), msgpack=True, key="b").status_code == 201
            assert post_batch(client, seeded, batch_body(2, seed=2), msgpack=True, key="b").status_code == 200
            assert batch_count(settings) == 2 and len(rollout_files(settings)) == 2
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" RESET lock_timeout'))
        admin.dispose()
