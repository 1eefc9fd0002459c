"""The dashboard's bounds: failed sign-ins per client address (a sliding window, a table of bounded
size, the address X-Forwarded-For cannot choose), and the sweeper's purge of expired sessions."""

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app import sweeper
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.main import create_app
from app.ui.login_limits import LoginFailures, login_failures_for
from app.ui.models import UiSession
from app.ui.sessions import COOKIE, purge_expired_sessions
from tests.app.api import TenantHandle
from tests.app.factories import end_read
from tests.common import FakeClock

MAX_FAILURES = 3
WINDOW = 60.0
ATTACKER = ("203.0.113.7", 40000)
SOMEONE_ELSE = ("198.51.100.9", 40000)


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"ui_login_max_failures": MAX_FAILURES, "ui_login_window_seconds": WINDOW}
    )


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def app(settings: Settings, clock: FakeClock) -> FastAPI:
    app = create_app(settings)
    app.state.ui_login_failures = login_failures_for(settings, clock=clock)
    return app


def post_key(client: TestClient, key: str, **headers: str):
    return client.post("/ui/login", data={"key": key}, headers=headers, follow_redirects=False)


def fail(client: TestClient, times: int) -> None:
    for _ in range(times):
        assert post_key(client, "llk_wrong").status_code == 401


def ui_sessions(db: Session) -> int:
    db.expire_all()
    count = db.scalar(select(func.count()).select_from(UiSession)) or 0
    end_read(db)
    return count


def test_past_the_bound_the_page_says_so_without_checking_the_key(
    app: FastAPI, tenant: TenantHandle, clock: FakeClock, db: Session
) -> None:
    with TestClient(app, client=ATTACKER) as attacker, TestClient(app, client=SOMEONE_ELSE) as other:
        fail(attacker, MAX_FAILURES)
        clock.now = 10.0
        # The right key now changes nothing: the answer must not tell a right guess from a wrong one.
        refused = post_key(attacker, tenant.key)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "50"
        assert "text/html" in refused.headers["content-type"]
        assert "Too many failed sign-ins from your address. Try again in 50 seconds." in refused.text
        assert COOKIE not in attacker.cookies and ui_sessions(db) == 0

        # Another address is not held back, and its sign-in frees nobody else.
        assert post_key(other, "llk_wrong").status_code == 401
        assert post_key(other, tenant.key).status_code == 303
        assert post_key(attacker, tenant.key).status_code == 429

        clock.now = WINDOW - 0.5
        assert post_key(attacker, tenant.key).headers["retry-after"] == "1"
        clock.now = WINDOW  # the first failure leaves the window
        assert post_key(attacker, tenant.key).status_code == 303


def test_a_successful_sign_in_does_not_clear_the_failures_of_its_address(
    app: FastAPI, tenant: TenantHandle
) -> None:
    """Else a tenant holding one valid key could sign in between guesses and guess at any rate."""
    with TestClient(app, client=ATTACKER) as attacker:
        fail(attacker, MAX_FAILURES - 1)
        assert post_key(attacker, tenant.key).status_code == 303
        fail(attacker, 1)
        assert post_key(attacker, tenant.key).status_code == 429


def test_x_forwarded_for_does_not_choose_the_address(app: FastAPI, tenant: TenantHandle) -> None:
    """No trusted proxy is configured (FORWARDED_ALLOW_IPS): the header is the client's to write."""
    with TestClient(app, client=ATTACKER) as attacker:
        for n in range(MAX_FAILURES):
            forged = post_key(attacker, "llk_wrong", **{"X-Forwarded-For": f"192.0.2.{n}"})
            assert forged.status_code == 401
        forged = post_key(attacker, tenant.key, **{"X-Forwarded-For": "192.0.2.200"})
        assert forged.status_code == 429


def test_an_ipv6_client_counts_by_its_64_network(app: FastAPI, tenant: TenantHandle) -> None:
    for n in range(MAX_FAILURES):
        with TestClient(app, client=(f"2001:db8:1:2::{n + 1:x}", 1)) as rotating:
            fail(rotating, 1)
    with TestClient(app, client=("2001:db8:1:2:ffff::1", 1)) as same_network:
        assert post_key(same_network, tenant.key).status_code == 429
    with TestClient(app, client=("2001:db8:1:3::1", 1)) as next_network:
        assert post_key(next_network, tenant.key).status_code == 303


def test_tries_in_flight_count_so_concurrent_guesses_cannot_pass_the_bound() -> None:
    """Five guesses at once, none answered yet: checking then recording let all five past a bound
    of three (review). Each admitted try counts until it signs in; a success takes back its own."""
    clock = FakeClock()
    failures = LoginFailures(max_failures=3, window_seconds=60, clock=clock)
    tries = [failures.admit("a") for _ in range(5)]
    assert tries[:3] == [0.0, 0.0, 0.0] and tries[3:] == [None, None]
    assert failures.retry_after("a") == 60
    failures.succeeded("a", 0.0)  # one of them had the right key
    clock.now = 1.0
    assert failures.admit("a") == 1.0
    assert failures.admit("a") is None


def test_the_window_slides() -> None:
    clock = FakeClock()
    failures = LoginFailures(max_failures=3, window_seconds=60, clock=clock)
    for at in (0.0, 30.0, 50.0):
        clock.now = at
        assert failures.retry_after("a") is None
        assert failures.admit("a") is not None  # a try that fails: admitted, never succeeded
    assert failures.retry_after("a") == 10
    clock.now = 60.0  # one try more, as the first failure leaves the window...
    assert failures.retry_after("a") is None
    assert failures.admit("a") is not None
    assert failures.retry_after("a") == 30  # ...and the next when the second does
    clock.now = 111.0
    assert failures.retry_after("a") is None


def test_rotating_addresses_does_not_grow_the_table() -> None:
    clock = FakeClock()
    failures = LoginFailures(max_failures=2, window_seconds=60, max_addresses=3, clock=clock)
    for n in range(100):
        assert failures.admit(f"10.0.0.{n}") is not None
        assert failures.admit(f"10.0.0.{n}") is not None
    assert failures.addresses() == 3
    assert failures.retry_after("10.0.0.99") == 60  # the latest are the ones kept
    assert failures.retry_after("10.0.0.0") is None
    clock.now = 60.0
    assert failures.retry_after("10.0.0.99") is None and failures.addresses() == 2  # aged out, forgotten


def test_defaults() -> None:
    fields = Settings.model_fields
    assert (fields["ui_login_max_failures"].default, fields["ui_login_window_seconds"].default) == (10, 300.0)


# ----------------------------------------------------------------------------- expired sessions


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def add_sessions(db: Session, *, expires_at: datetime, count: int, prefix: str) -> list[str]:
    ids = [f"{prefix}{n:062d}" for n in range(count)]
    for id_ in ids:
        db.add(
            UiSession(
                id=id_,
                is_admin=True,
                csrf_token="t",
                created_at=expires_at - timedelta(hours=12),
                expires_at=expires_at,
            )
        )
    db.commit()
    return ids


def remaining(db: Session) -> set[str]:
    db.expire_all()
    ids = set(db.scalars(select(UiSession.id)))
    end_read(db)
    return ids


def test_the_sweeper_purges_expired_sessions_a_bounded_batch_at_a_time(
    db: Session, settings: Settings, factory: sessionmaker[Session]
) -> None:
    now = datetime.now(UTC)
    expired = add_sessions(db, expires_at=now - timedelta(seconds=1), count=5, prefix="ex")
    at_the_instant = add_sessions(db, expires_at=now, count=1, prefix="at")  # resolve() refuses it too
    live = add_sessions(db, expires_at=now + timedelta(minutes=1), count=2, prefix="li")

    with factory() as s:
        assert purge_expired_sessions(s, now=now, limit=2) == 2
        s.commit()
    assert len(remaining(db) & set(expired)) == 3

    result = sweeper.sweep_once(factory, settings=settings, now=now)
    assert result.errors == [] and result.purged_ui_sessions == 4
    assert remaining(db) == set(live)
    assert sweeper.sweep_once(factory, settings=settings, now=now).purged_ui_sessions == 0
    assert not set(at_the_instant) & remaining(db)
