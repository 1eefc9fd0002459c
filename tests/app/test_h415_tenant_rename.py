"""`PATCH /v1/tenants/{tenant_id}` `{"name": ...}` renames a tenant (admin), alone or with its quota.
Until now the only way was SQL (migration 0023's collision message sends operators to rename).

The name is validated as at creation; a name another tenant has whatever the case is a 409 naming that
tenant, and nothing changes (the quota sent with it neither); another case of the tenant's own name is
a rename. Its id, keys and runs stay. One `tenant.updated` event names what changed with its previous
value, none when nothing did. Both databases (the race with a committed rival: Postgres)."""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.config import Settings
from app.events.models import Event
from app.tenants import quota
from app.tenants.models import Tenant
from app.tenants.service import tenant_named
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, TenantHandle, create_run, new_tenant
from tests.app.factories import committed, make_tenant


def _patch(client: TestClient, tenant_id: str, body: Any, headers: dict[str, str] = ADMIN_HEADERS) -> Any:
    return client.patch(f"/v1/tenants/{tenant_id}", json=body, headers=headers)


def _row(db: Session, tenant_id: str) -> tuple[str, int]:
    db.expire_all()
    tenant = db.get(Tenant, tenant_id)
    assert tenant is not None
    row = (tenant.name, tenant.max_concurrent_runs)
    db.rollback()  # ends the read (on SQLite an open reader holds the writers back)
    return row


def _updates(db: Session, tenant_id: str) -> list[dict[str, Any]]:
    events = db.scalars(
        select(Event).where(Event.tenant_id == tenant_id, Event.action == "tenant.updated").order_by(Event.id)
    ).all()
    details = [e.details for e in events]
    assert all(e.actor == "admin" for e in events)
    db.rollback()
    return details


def test_a_tenant_is_renamed_and_keeps_its_id_keys_and_runs(client: TestClient, db: Session) -> None:
    tenant = new_tenant(client, quota=2, name="acme")
    run_id = create_run(client, tenant, name="r")["id"]

    r = _patch(client, tenant.id, {"name": "globex"})
    assert r.status_code == 200, r.text
    assert r.json() | {"created_at": None} == {
        "id": tenant.id,
        "name": "globex",
        "max_concurrent_runs": 2,
        "created_at": None,
    }
    listed = client.get("/v1/tenants", headers=ADMIN_HEADERS).json()["items"]
    assert [t["name"] for t in listed if t["id"] == tenant.id] == ["globex"]
    assert _row(db, tenant.id) == ("globex", 2)
    # Its key still answers for it, and its run is still its own.
    r = client.get(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert r.status_code == 200 and r.json()["tenant_id"] == tenant.id, r.text
    assert _updates(db, tenant.id) == [{"name": "globex", "previous_name": "acme"}]
    # The old name is free again.
    assert new_tenant(client, name="acme").id != tenant.id


def test_a_rename_and_a_quota_in_one_request_are_one_event(client: TestClient, db: Session) -> None:
    tenant = new_tenant(client, quota=1, name="acme")
    r = _patch(client, tenant.id, {"name": "initech", "max_concurrent_runs": 4})
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["max_concurrent_runs"]) == ("initech", 4)
    assert _updates(db, tenant.id) == [
        {
            "name": "initech",
            "previous_name": "acme",
            "max_concurrent_runs": 4,
            "previous_max_concurrent_runs": 1,
        }
    ]


def test_another_case_of_its_own_name_is_a_rename_and_the_same_name_changes_nothing(
    client: TestClient, db: Session
) -> None:
    tenant = new_tenant(client, name="acme")
    r = _patch(client, tenant.id, {"name": "Acme"})
    assert r.status_code == 200 and r.json()["name"] == "Acme", r.text
    assert _patch(client, tenant.id, {"name": "Acme"}).status_code == 200
    assert _row(db, tenant.id)[0] == "Acme"
    assert _updates(db, tenant.id) == [{"name": "Acme", "previous_name": "acme"}]


@pytest.mark.parametrize("taken", ["globex", "Globex", "GLOBEX"])
def test_a_name_another_tenant_has_whatever_the_case_is_a_409_naming_it(
    client: TestClient, db: Session, taken: str
) -> None:
    holder = new_tenant(client, name="Globex")
    tenant = new_tenant(client, quota=2, name="acme")
    r = _patch(client, tenant.id, {"name": taken, "max_concurrent_runs": 5})
    assert r.status_code == 409, r.text
    assert set(r.json()) == {"error"}
    error = r.json()["error"]
    assert error["code"] == "conflict"
    assert holder.id in error["message"] and "'Globex'" in error["message"], error
    assert error["details"] == {"tenant_id": holder.id, "name": "Globex"}
    # Nothing changed: neither the name nor the quota sent with it; no event.
    assert _row(db, tenant.id) == ("acme", 2)
    assert _row(db, holder.id) == ("Globex", 2)
    assert _updates(db, tenant.id) == []


def test_a_racing_rename_loses_with_a_409_naming_the_winner(
    client: TestClient, db: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check saw no such name (the other tenant's write committed right after it): the unique index
    refuses the write, and the 409 still names the tenant that has the name, not a 500."""
    holder = new_tenant(client, name="Hooli")
    tenant = new_tenant(client, name="acme")
    real = tenant_named
    calls: list[str] = []

    def blind_once(session: Session, *, name: str, other_than: str | None = None) -> Tenant | None:
        calls.append(name)
        return None if len(calls) == 1 else real(session, name=name, other_than=other_than)

    monkeypatch.setattr(quota, "tenant_named", blind_once)
    r = _patch(client, tenant.id, {"name": "hooli"})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["details"] == {"tenant_id": holder.id, "name": "Hooli"}
    assert calls == ["hooli", "hooli"]  # the check, then the look-up after the index refused
    assert _row(db, tenant.id)[0] == "acme"
    assert _updates(db, tenant.id) == []


@pytest.mark.postgres_only
def test_a_rival_committed_between_the_check_and_the_write_is_named_in_the_409(
    client: TestClient, db: Session, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real race at a pause point: right after the rename's check found the name free, another
    transaction creates a tenant of that name and commits. (SQLite serialises writers: no race there.)"""
    tenant = new_tenant(client, name="acme")
    real = tenant_named
    rival: list[str] = []

    def rival_commits_after_the_check(
        session: Session, *, name: str, other_than: str | None = None
    ) -> Tenant | None:
        found = real(session, name=name, other_than=other_than)
        if not rival:
            assert found is None
            with committed(settings) as other:
                rival.append(make_tenant(other, name="Pied-Piper")[0].id)
        return found

    monkeypatch.setattr(quota, "tenant_named", rival_commits_after_the_check)
    r = _patch(client, tenant.id, {"name": "pied-piper", "max_concurrent_runs": 3})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["details"] == {"tenant_id": rival[0], "name": "Pied-Piper"}
    assert _row(db, tenant.id) == ("acme", 2)
    assert _updates(db, tenant.id) == []


BAD_NAMES = ["", "x" * 129, "-acme", ".acme", "has space", "a/b", "ünïcode", "tab\there", 7, ["acme"]]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_bad_name_is_refused_as_at_creation_and_nothing_changes(
    client: TestClient, db: Session, name: Any
) -> None:
    tenant = new_tenant(client, quota=2, name="acme")
    created = client.post("/v1/tenants", json={"name": name}, headers=ADMIN_HEADERS)
    assert created.status_code == 422, created.text
    r = _patch(client, tenant.id, {"name": name, "max_concurrent_runs": 3})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    assert [d["loc"] for d in error["details"]] == [["body", "name"]], error
    # The rule of creation is the rule of a rename: the same problem (not an unknown field's).
    assert [d["type"] for d in error["details"]] == [d["type"] for d in created.json()["error"]["details"]]
    assert _row(db, tenant.id) == ("acme", 2)
    assert _updates(db, tenant.id) == []


def test_a_name_valid_at_creation_is_valid_for_a_rename(client: TestClient) -> None:
    tenant = new_tenant(client)
    for name in ("x" * 128, "A", "0.a_b-c"):
        r = _patch(client, tenant.id, {"name": name})
        assert r.status_code == 200 and r.json()["name"] == name, r.text


@pytest.mark.parametrize("body", [{}, {"name": None}, {"name": None, "max_concurrent_runs": None}])
def test_nothing_to_change_is_a_422_naming_both_fields(client: TestClient, db: Session, body: Any) -> None:
    tenant = new_tenant(client, quota=2, name="acme")
    r = _patch(client, tenant.id, body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error" and "nothing to change" in error["message"], error
    assert [d["loc"] for d in error["details"]] == [["body", "max_concurrent_runs"], ["body", "name"]]
    assert _row(db, tenant.id) == ("acme", 2)


def test_an_unknown_tenant_is_a_404(client: TestClient) -> None:
    r = _patch(client, "ten_000000000000", {"name": "globex"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def test_only_the_admin_key_renames(client: TestClient, db: Session, tenant: TenantHandle) -> None:
    body = {"name": "mine-now"}
    assert client.patch(f"/v1/tenants/{tenant.id}", json=body).status_code == 401
    assert _patch(client, tenant.id, body, {"Authorization": "Bearer nope"}).status_code == 401
    r = _patch(client, tenant.id, body, tenant.headers)  # a tenant cannot rename itself
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    assert _patch(client, tenant.id, body, WORKER_HEADERS).status_code == 403
    assert _row(db, tenant.id)[0] == tenant.name
    assert _updates(db, tenant.id) == []
    r = _patch(client, tenant.id, body)  # the admin's
    assert r.status_code == 200 and r.json()["name"] == "mine-now", r.text


def test_the_document_offers_the_name_and_the_409(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    op = doc["paths"]["/v1/tenants/{tenant_id}"]["patch"]
    assert {"404", "409", "415", "422"} <= set(op["responses"])
    update = doc["components"]["schemas"]["TenantUpdate"]
    assert set(update["properties"]) == {"name", "max_concurrent_runs"} and not update.get("required")
    create = doc["components"]["schemas"]["TenantCreate"]["properties"]["name"]
    renamed = [s for s in update["properties"]["name"]["anyOf"] if s.get("type") == "string"]
    assert [{k: s[k] for k in ("pattern", "minLength", "maxLength")} for s in renamed] == [
        {k: create[k] for k in ("pattern", "minLength", "maxLength")}
    ]
