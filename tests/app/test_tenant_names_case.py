"""Tenant names are unique whatever their case: `Acme` and `acme` are one name. Creating a name that
differs from a tenant's only in case is a 409, as a duplicate is; the database holds it too (the
unique index on lower(name), migration 0023), which a creation racing another meets. Migration 0023
refuses rows that already collide, naming them, and changes nothing (no tenant renamed)."""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.util import CommandError
from fastapi.testclient import TestClient
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from app import migrate
from app.db import make_engine
from app.tenants.models import Tenant
from contracts.ids import new_id
from loraloom.cli import cli
from tests.app.api import ADMIN_HEADERS
from tests.app.migration_db import empty_database


def _create(client: TestClient, name: str) -> tuple[int, dict]:
    r = client.post("/v1/tenants", json={"name": name}, headers=ADMIN_HEADERS)
    return r.status_code, r.json()


def test_a_name_differing_only_in_case_is_a_conflict(client: TestClient) -> None:
    status, acme = _create(client, "Acme")
    assert status == 201, acme
    for name in ("acme", "ACME", "aCmE"):
        status, body = _create(client, name)
        assert status == 409, body
        assert body["error"]["code"] == "conflict"
        assert "'Acme' already exists" in body["error"]["message"], body  # the name as it is held
        assert body["error"]["details"] == {"name": "Acme"}
    status, body = _create(client, "Acme")  # the exact duplicate, as before
    assert status == 409 and body["error"]["message"] == "a tenant named 'Acme' already exists", body
    assert _create(client, "acme-2")[0] == 201
    names = [t["name"] for t in client.get("/v1/tenants", headers=ADMIN_HEADERS).json()["items"]]
    assert names == ["Acme", "acme-2"]


def test_the_database_holds_the_rule_for_a_racing_creation(db: Session) -> None:
    """Two creations at once both pass the service's read; the index refuses the second."""
    db.add(Tenant(id=new_id("ten"), name="Globex", max_concurrent_runs=2))
    db.commit()
    db.add(Tenant(id=new_id("ten"), name="GLOBEX", max_concurrent_runs=2))
    with pytest.raises(IntegrityError, match="uq_tenants_lower_name"):
        db.commit()
    db.rollback()


def test_a_racing_creation_is_a_409_not_a_500(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's read saw no such name (another creation committed right after it): the insert's
    unique violation is the 409."""
    assert _create(client, "Initech")[0] == 201
    real_scalar = Session.scalar

    def blind(self: Session, statement: Any, *args: Any, **kwargs: Any) -> Any:
        if "lower(tenants.name)" in str(statement):
            return None  # the read ran before the other creation's commit
        return real_scalar(self, statement, *args, **kwargs)

    monkeypatch.setattr(Session, "scalar", blind)
    status, body = _create(client, "INITECH")
    assert status == 409, body
    assert body["error"] == {
        "code": "conflict",
        "message": "a tenant named 'INITECH' already exists",
        "details": None,
    }


# --------------------------------------------------------------------------- migration 0023


@pytest.fixture
def url_at_0022(tmp_path: Path) -> Iterator[str]:
    with empty_database(tmp_path) as url:
        migrate.upgrade(url, "0022")
        yield url


def _insert_tenants(engine: Engine, names: list[str]) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO tenants (id, name, max_concurrent_runs, created_at) "
                "VALUES (:id, :name, 2, CURRENT_TIMESTAMP)"
            ),
            [{"id": new_id("ten"), "name": name} for name in names],
        )


def _names(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.scalars(text("SELECT name FROM tenants")))


def _schema(engine: Engine) -> tuple[set[str], set[str]]:
    """(tables, index names of `tenants`) as the database has them."""
    inspector = inspect(engine)
    tables = set(inspector.get_table_names())
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            sql = "SELECT indexname FROM pg_indexes WHERE tablename = 'tenants'"
        else:
            sql = "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tenants'"
        indexes = set(conn.scalars(text(sql)))
    return tables, indexes


def test_the_migration_refuses_colliding_names_and_changes_nothing(url_at_0022: str) -> None:
    engine = make_engine(url_at_0022)
    try:
        names = ["Acme", "globex", "acme", "solo", "Globex", "ACME"]
        _insert_tenants(engine, names)
        with pytest.raises(CommandError) as refused:
            migrate.upgrade(url_at_0022)
        message = str(refused.value)
        assert "'ACME', 'Acme', 'acme'; 'Globex', 'globex'" in message, message
        assert "solo" not in message and "Rename or delete" in message
        assert migrate.database_revision(url_at_0022) == "0022"
        assert _names(engine) == sorted(names)  # nobody renamed
        tables, indexes = _schema(engine)
        assert "deleted_run_ids" not in tables and "uq_tenants_lower_name" not in indexes

        # The operator settles it; the upgrade then goes through, and the index holds the rule.
        with engine.begin() as conn:
            conn.execute(text("UPDATE tenants SET name = 'acme-eu' WHERE name = 'acme'"))
            conn.execute(text("DELETE FROM tenants WHERE name IN ('ACME', 'Globex')"))
        migrate.upgrade(url_at_0022)
        assert migrate.database_revision(url_at_0022) == migrate.head_revision()
        tables, indexes = _schema(engine)
        assert "deleted_run_ids" in tables and "uq_tenants_lower_name" in indexes
        with pytest.raises(IntegrityError, match="uq_tenants_lower_name"):
            _insert_tenants(engine, ["SOLO"])

        migrate.downgrade(url_at_0022, "0022")
        tables, indexes = _schema(engine)
        assert "deleted_run_ids" not in tables and "uq_tenants_lower_name" not in indexes
        _insert_tenants(engine, ["SOLO"])  # case-sensitive again, as at 0022
    finally:
        engine.dispose()


def test_db_upgrade_says_which_names_collide(url_at_0022: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`loraloom db upgrade` prints the migration's message as its error, not a traceback."""
    engine = make_engine(url_at_0022)
    try:
        _insert_tenants(engine, ["Acme", "acme"])
    finally:
        engine.dispose()
    monkeypatch.setenv("LORALOOM_DATABASE_URL", url_at_0022)
    result = CliRunner().invoke(cli, ["db", "upgrade"])
    assert result.exit_code == 2, result.output
    assert "'Acme', 'acme'" in result.stderr and "Traceback" not in result.output, result.output
    assert migrate.database_revision(url_at_0022) == "0022"
