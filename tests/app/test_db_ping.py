"""app/db.py ping_after_idle: a pooled connection is pinged only after it was idle, and a dead one
is replaced before a statement meets it."""

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine.interfaces import DBAPIConnection

from app.config import Settings
from app.db import ping_after_idle

pytestmark = pytest.mark.postgres_only


def _engine(settings: Settings, idle_seconds: float) -> tuple[Engine, list[DBAPIConnection]]:
    engine = create_engine(settings.database_url, pool_size=1, max_overflow=0)
    ping_after_idle(engine, idle_seconds)
    pings: list[DBAPIConnection] = []
    real_ping = engine.dialect.do_ping

    def counting_ping(dbapi_conn: DBAPIConnection) -> bool:
        pings.append(dbapi_conn)
        return real_ping(dbapi_conn)

    setattr(engine.dialect, "do_ping", counting_ping)  # noqa: B010 - this engine's dialect only
    return engine, pings


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _terminate(settings: Settings, pid: int) -> None:
    url = settings.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))


def test_a_connection_back_from_a_recent_checkout_is_not_pinged(settings):
    engine, pings = _engine(settings, idle_seconds=3600)
    first = _backend_pid(engine)  # a new connection: pinged once (it has no idle time yet)
    assert len(pings) == 1
    for _ in range(3):
        assert _backend_pid(engine) == first
    assert len(pings) == 1  # each reuse came back within the idle bound: no round trip spent
    engine.dispose()


def test_an_idle_connection_killed_by_the_server_is_replaced_before_use(settings):
    engine, pings = _engine(settings, idle_seconds=0)  # every checkout is "after idle"
    first = _backend_pid(engine)
    _terminate(settings, first)
    second = _backend_pid(engine)  # the ping finds it dead; the pool opens another
    assert second != first
    assert len(pings) >= 3  # first checkout, the failed ping, the new connection's
    engine.dispose()
