"""app/db.py ping_when_in_doubt: a pooled connection is pinged only after it was idle or when its
socket has something to read, and a connection the server dropped is replaced before a statement
meets it, even one used a moment before."""

import time
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, create_engine, text

from app.config import Settings
from app.db import ping_when_in_doubt
from app.key_cache import ApiKeyCache
from app.main import create_app
from tests.app.api import batch_body, post_batch
from tests.app.factories import batch_count, seed_run

pytestmark = pytest.mark.postgres_only


def _engine(settings: Settings, idle_seconds: float) -> tuple[Engine, list[object]]:
    engine = create_engine(settings.database_url, pool_size=1, max_overflow=0)
    ping_when_in_doubt(engine, idle_seconds)
    pings: list[object] = []
    real_ping = engine.dialect.do_ping

    def counting_ping(dbapi_conn: Any) -> bool:
        pings.append(dbapi_conn)
        return real_ping(dbapi_conn)

    engine.dialect.do_ping = counting_ping  # type: ignore[method-assign,assignment]
    return engine, pings


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _admin(settings: Settings) -> psycopg.Connection:
    return psycopg.connect(
        settings.database_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    )


def _terminate(settings: Settings, pids: list[int] | None = None) -> None:
    """Terminate the given backends (default: every other backend of the test database) and wait until
    they are gone, so the server has closed their sockets before the test goes on."""
    with _admin(settings) as admin:
        if pids is None:
            pids = [
                row[0]
                for row in admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ]
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
        ).fetchone() != (0,):
            assert time.monotonic() < deadline, "the backends did not exit"
            time.sleep(0.01)


def test_a_connection_back_from_a_recent_checkout_is_not_pinged(settings):
    engine, pings = _engine(settings, idle_seconds=3600)
    first = _backend_pid(engine)  # a new connection: pinged once (it has no idle time yet)
    assert len(pings) == 1
    for _ in range(3):
        assert _backend_pid(engine) == first
    assert len(pings) == 1  # each reuse came back within the idle bound, its socket quiet: no round trip
    engine.dispose()


def test_an_idle_connection_killed_by_the_server_is_replaced_before_use(settings):
    engine, pings = _engine(settings, idle_seconds=0)  # every checkout is "after idle"
    first = _backend_pid(engine)
    _terminate(settings, [first])
    second = _backend_pid(engine)  # the ping finds it dead; the pool opens another
    assert second != first
    assert len(pings) >= 3  # first checkout, the failed ping, the new connection's
    engine.dispose()


def test_a_connection_killed_moments_after_use_is_replaced_before_use(settings):
    engine, pings = _engine(settings, idle_seconds=3600)  # never "after idle" again
    first = _backend_pid(engine)
    _terminate(settings, [first])  # its socket now holds the server's farewell
    second = _backend_pid(engine)
    assert second != first
    assert len(pings) >= 2  # the readable socket was pinged (and failed), then the new connection
    engine.dispose()


def test_a_batch_right_after_the_server_dropped_its_connection_is_stored(settings):
    app = create_app(settings)
    app.state.api_key_cache = ApiKeyCache(60.0)
    seeded = seed_run(settings)
    with TestClient(app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201
        assert post_batch(client, seeded, batch_body(1, seed=1)).status_code == 201  # the fast path
        _terminate(settings)  # every pooled connection of the service, used within the last second
        r = post_batch(client, seeded, batch_body(1, seed=2))
        assert r.status_code == 201, r.text  # not a 503: the dead connection never met a statement
    assert batch_count(settings) == 3
