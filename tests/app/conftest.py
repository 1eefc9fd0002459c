"""Fixtures for the control-plane tests: the app in-process (TestClient, the ASGI transport),
the app under real uvicorn, and helpers to make tenants and keys through the admin API."""

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.config import Settings
from app.db import make_engine, make_session_factory
from app.main import create_app
from tests.common import ADMIN_KEY

ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}


@dataclass(frozen=True)
class TenantHandle:
    id: str
    name: str
    key: str
    key_id: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def new_tenant(client: TestClient | httpx.Client, *, quota: int = 2, name: str | None = None) -> TenantHandle:
    """A tenant and one API key, through the admin API."""
    name = name or f"t-{uuid.uuid4().hex[:8]}"
    r = client.post("/v1/tenants", json={"name": name, "max_concurrent_runs": quota}, headers=ADMIN_HEADERS)
    assert r.status_code == 201, r.text
    tenant_id = r.json()["id"]
    r = client.post(f"/v1/tenants/{tenant_id}/keys", headers=ADMIN_HEADERS)
    assert r.status_code == 201, r.text
    return TenantHandle(id=tenant_id, name=name, key=r.json()["key"], key_id=r.json()["id"])


def create_run(
    client: TestClient | httpx.Client,
    tenant: TenantHandle,
    *,
    name: str = "r",
    expect: int = 201,
    **config: Any,
) -> dict:
    r = client.post("/v1/runs", json={"name": name, "config": config}, headers=tenant.headers)
    assert r.status_code == expect, r.text
    return r.json()


def row_counts(settings: Settings, *models: Any) -> tuple[int, ...]:
    """Rows per table, read on a connection of its own (so it sees only committed data)."""
    engine = make_engine(settings.database_url)
    try:
        with Session(engine) as session:
            return tuple(session.scalar(select(func.count()).select_from(m)) or 0 for m in models)
    finally:
        engine.dispose()


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


class LiveServer:
    """The app under real uvicorn on 127.0.0.1 (a free port), in a thread."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()


@pytest.fixture
def live_server(app: FastAPI) -> Iterator[LiveServer]:
    with LiveServer(app) as server:
        yield server


@pytest.fixture
def http(live_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        yield c
