"""Fixtures for the control-plane tests: the app in-process (TestClient), the app under real
uvicorn, a session on the test database, and tenants made through the admin API.

Fixtures only: the helpers they use live in tests/app/api.py and tests/app/factories.py.
"""

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.batches import lean_route
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.main import create_app
from tests.app.api import LiveServer, TenantHandle, new_tenant


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def db(settings: Settings) -> Iterator[Session]:
    """A session on the test database, for setting up and checking state directly."""
    engine = make_engine(settings.database_url)
    with make_session_factory(engine)() as session:
        yield session
    engine.dispose()


@pytest.fixture
def tenant(client: TestClient) -> TenantHandle:
    return new_tenant(client)


@pytest.fixture
def other_tenant(client: TestClient) -> TenantHandle:
    return new_tenant(client)


@pytest.fixture
def live_server(app: FastAPI) -> Iterator[LiveServer]:
    with LiveServer(app) as server:
        yield server


@pytest.fixture
def http(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        yield c


@pytest.fixture
def fast_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run ids of the batch submissions the hot route's fast path handled (app/batches/lean_route.py)."""
    calls: list[str] = []
    real = lean_route._submit_in_thread

    def counted(request: Any, lean: Any, body: bytes) -> Any:
        calls.append(lean.run_id)
        return real(request, lean, body)

    monkeypatch.setattr(lean_route, "_submit_in_thread", counted)
    return calls
