"""Engine, session factory, the declarative Base and the typed session dependency."""

import select
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from functools import lru_cache
from typing import Annotated, Any

import psycopg
from fastapi import Depends, Request
from sqlalchemy import ClauseElement, CursorResult, Delete, MetaData, Update, create_engine, event
from sqlalchemy.dialects.postgresql import Insert as PgInsert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.dialects.sqlite import Insert as SqliteInsert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

# Stable constraint names, so Alembic migrations and autogenerate agree on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    return datetime.now(UTC)


def conflict_insert(dialect: str, table: Any) -> PgInsert | SqliteInsert:
    """INSERT into `table` in the dialect that can add ON CONFLICT (Postgres and SQLite spell it alike)."""
    return pg_insert(table) if dialect == "postgresql" else sqlite_insert(table)


def rows_changed(session: Session, stmt: Update | Delete) -> int:
    """Execute an UPDATE or DELETE; returns how many rows it changed."""
    result = session.execute(stmt)
    assert isinstance(result, CursorResult)  # what DML returns; the declared type is the general Result
    return result.rowcount


# --------------------------------------------------------------------------- Postgres, directly
# The ingestion hot path runs its few statements on the psycopg connection of the SQLAlchemy
# connection it holds (same pool, same pre-ping, same transaction), skipping SQLAlchemy's
# per-statement work (0.06-0.25 ms of CPU each: bench/ingest_statements.py), as server-side
# prepared statements. A driver error goes through SQLAlchemy's own handling
# (Connection._handle_dbapi_exception): the same exception classes (OperationalError,
# IntegrityError, DataError…), the connection invalidated on a disconnect, so the error guard
# answers exactly as it does for a statement run through SQLAlchemy.


@lru_cache(maxsize=64)
def pg_sql(statement: ClauseElement) -> tuple[str, Mapping[str, Any]]:
    """`statement` compiled once for psycopg (`%(name)s` parameters), with the values of the
    parameters it carries itself (literals in a WHERE, a LIMIT); those without a value are the caller's."""
    compiled = statement.compile(dialect=_PG_DIALECT)
    return compiled.string, {k: v for k, v in compiled.params.items() if v is not None}


_PG_DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]


def pg_execute(
    connection: Connection, statement: ClauseElement, params: Mapping[str, Any]
) -> tuple[Any, ...] | None:
    """Run `statement` (compiled by pg_sql) on `connection`'s psycopg connection as a prepared
    statement, in the connection's transaction; its first row, or None."""
    sql, own = pg_sql(statement)
    values = {**own, **params} if own else params
    driver = connection.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    try:
        cursor = driver.execute(sql, values, prepare=True)
        return cursor.fetchone() if cursor.description is not None else None
    except Exception as exc:
        # Translated (or re-raised as it is) exactly as a statement run through SQLAlchemy.
        connection._handle_dbapi_exception(exc, sql, values, None, None)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.close()
            # pysqlite's own transaction handling defers BEGIN; take the write lock at the
            # start of every transaction instead, so read-then-write admission is serialised.
            dbapi_conn.isolation_level = None

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:  # pragma: no cover - trivial
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    engine = create_engine(url, pool_size=10, max_overflow=20)
    ping_when_in_doubt(engine)
    return engine


PING_AFTER_IDLE_SECONDS = 1.0
"""A pooled connection idle for longer is pinged before use (see ping_when_in_doubt)."""

_IDLE_SINCE = "loraloom_idle_since"


def ping_when_in_doubt(engine: Engine, idle_seconds: float = PING_AFTER_IDLE_SECONDS) -> None:
    """SQLAlchemy's pre-ping (a round trip on every checkout: ~5 % of a batch submission's CPU in the
    service, bench/ingest_ab.py), only where it can find something: a connection idle for more than
    `idle_seconds`, or one whose socket has something to read. A pooled connection, idle between
    transactions, is sent nothing by the server unless it is going away: a backend terminated, or the
    server shutting down, first sends its error and closes the socket, which a zero-timeout poll sees
    without a round trip. What neither finds (a network that silently dropped the connection within
    the last second) fails the request as the database unreachable (503 with Retry-After)."""

    @event.listens_for(engine.pool, "checkin")
    def _checked_in(_dbapi_conn: Any, record: ConnectionPoolEntry) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine.pool, "checkout")
    def _checked_out(dbapi_conn: Any, record: ConnectionPoolEntry, _proxy: Any) -> None:
        idle_since = record.info.get(_IDLE_SINCE)
        recent = idle_since is not None and time.monotonic() - idle_since <= idle_seconds
        if recent and not _has_input(dbapi_conn):
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            # The pool discards this connection and checks out (or opens) another.
            raise DisconnectionError("stale pooled connection") from exc


def _has_input(dbapi_conn: Any) -> bool:
    """True if the connection's socket is readable, closed or in error (or the driver says it is
    closed): worth a ping."""
    if not isinstance(dbapi_conn, psycopg.Connection) or dbapi_conn.closed:
        return True
    try:
        poller = select.poll()
        poller.register(dbapi_conn.pgconn.socket, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, psycopg.Error):
        return True


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


def get_session(request: Request) -> Iterator[Session]:
    """One session per request: commit when the handler returns, roll back on any error."""
    factory: sessionmaker[Session] = request.app.state.session_factory
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


# scope="function": commit before the response is sent, so a 2xx means the row is durable.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
