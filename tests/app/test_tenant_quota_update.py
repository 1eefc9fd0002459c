"""`PATCH /v1/tenants/{tenant_id}` and `loraloom tenants update`: an operator changes a tenant's quota
of concurrent runs after its creation. Lowered below its active runs, those keep their slots and its
queued runs wait until it is under the new quota; raised, its queued runs that now fit are admitted at
once (not at the next run leaving a slot). Bounds as at creation, 404 for an unknown tenant, 422 for a
body changing nothing or an invalid name (renames: test_h415_tenant_rename.py), admin key only; an audit
event for each change."""

import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from app.config import Settings
from app.db import make_engine, make_session_factory
from app.events.models import Event
from app.main import create_app
from app.runs.admission import ADMISSION_LOCK_KEY
from app.tenants.models import Tenant
from loraloom.cli import cli
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, TenantHandle, create_run, new_tenant
from tests.common import ADMIN_KEY, wait_for_a_lock_waiter

SLOTS = 4


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Slots to spare (no pool: `max_concurrent_runs` slots per base model), so that only the
    tenant's quota holds its runs back."""
    return settings.model_copy(update={"max_concurrent_runs": SLOTS})


def _patch(client: TestClient, tenant_id: str, body: Any, headers: dict[str, str] = ADMIN_HEADERS) -> Any:
    return client.patch(f"/v1/tenants/{tenant_id}", json=body, headers=headers)


def _status(client: TestClient, tenant: TenantHandle, run_id: str) -> str:
    r = client.get(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert r.status_code == 200, r.text
    status: str = r.json()["status"]
    return status


def _evict(client: TestClient, tenant: TenantHandle, run_id: str) -> None:
    r = client.post(f"/v1/runs/{run_id}/evict", json={"reason": "done"}, headers=tenant.headers)
    assert r.status_code == 200, r.text


def test_raising_the_quota_admits_the_queued_runs_that_now_fit_at_once(
    client: TestClient, db: Session
) -> None:
    tenant = new_tenant(client, quota=1)
    first = create_run(client, tenant, name="first")["id"]
    second = create_run(client, tenant, name="second")["id"]
    third = create_run(client, tenant, name="third")["id"]
    assert [_status(client, tenant, r) for r in (first, second, third)] == ["active", "queued", "queued"]

    r = _patch(client, tenant.id, {"max_concurrent_runs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == tenant.id and body["name"] == tenant.name and body["max_concurrent_runs"] == 2
    assert body["created_at"].endswith("Z")
    # The oldest queued run took the quota's new room now, not when some run leaves a slot.
    assert [_status(client, tenant, r) for r in (first, second, third)] == ["active", "active", "queued"]
    listed = client.get("/v1/tenants", headers=ADMIN_HEADERS).json()["items"]
    assert [t["max_concurrent_runs"] for t in listed if t["id"] == tenant.id] == [2]

    events = db.scalars(select(Event).where(Event.tenant_id == tenant.id).order_by(Event.id)).all()
    updated = [e for e in events if e.action == "tenant.updated"]
    assert [(e.actor, e.details) for e in updated] == [
        ("admin", {"max_concurrent_runs": 2, "previous_max_concurrent_runs": 1})
    ]
    assert [e.run_id for e in events if e.action == "run.admitted" and e.id > updated[0].id] == [second]


def test_lowering_the_quota_keeps_active_runs_and_holds_new_admissions(client: TestClient) -> None:
    tenant = new_tenant(client, quota=3)
    active = [create_run(client, tenant, name=f"a{i}")["id"] for i in range(3)]
    waiting = create_run(client, tenant, name="waiting")["id"]
    assert [_status(client, tenant, r) for r in active] == ["active"] * 3
    assert _status(client, tenant, waiting) == "queued"

    r = _patch(client, tenant.id, {"max_concurrent_runs": 1})
    assert r.status_code == 200 and r.json()["max_concurrent_runs"] == 1, r.text
    assert [_status(client, tenant, r) for r in active] == ["active"] * 3  # they keep their slots

    # A slot is free (SLOTS = 4), but the tenant is not under its new quota until one run is left.
    _evict(client, tenant, active[0])
    _evict(client, tenant, active[1])
    assert _status(client, tenant, waiting) == "queued"
    reason = client.get(f"/v1/runs/{waiting}", headers=tenant.headers).json()
    assert "quota of 1" in json.dumps(reason), reason
    _evict(client, tenant, active[2])
    assert _status(client, tenant, waiting) == "active"
    # And a new run waits behind it, as the quota of 1 says.
    assert _status(client, tenant, create_run(client, tenant, name="later")["id"]) == "queued"


def test_the_same_quota_again_changes_nothing(client: TestClient, db: Session) -> None:
    tenant = new_tenant(client, quota=2)
    r = _patch(client, tenant.id, {"max_concurrent_runs": 2})
    assert r.status_code == 200 and r.json()["max_concurrent_runs"] == 2, r.text
    assert db.scalar(select(Event.id).where(Event.action == "tenant.updated")) is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_concurrent_runs": 0}, "max_concurrent_runs"),
        ({"max_concurrent_runs": 1025}, "max_concurrent_runs"),
        ({"max_concurrent_runs": -1}, "max_concurrent_runs"),
        ({"max_concurrent_runs": "3"}, "max_concurrent_runs"),
        ({"max_concurrent_runs": True}, "max_concurrent_runs"),
        ({"max_concurrent_runs": 2.5}, "max_concurrent_runs"),
        ({}, "max_concurrent_runs"),
        ({"max_concurrent_runs": 3, "name": ""}, "name"),
        ({"name": "bad\nname"}, "name"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field_and_nothing_changes(
    client: TestClient, db: Session, body: dict[str, Any], field: str
) -> None:
    tenant = new_tenant(client, quota=2)
    r = _patch(client, tenant.id, body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "validation_error"
    assert field in [d["loc"][-1] for d in error["details"]], error
    db.expire_all()
    assert db.scalar(select(Tenant.max_concurrent_runs).where(Tenant.id == tenant.id)) == 2
    assert db.scalar(select(Tenant.name).where(Tenant.id == tenant.id)) == tenant.name


def test_the_bounds_are_those_of_creation(client: TestClient) -> None:
    tenant = new_tenant(client, quota=2)
    assert _patch(client, tenant.id, {"max_concurrent_runs": 1024}).json()["max_concurrent_runs"] == 1024
    assert _patch(client, tenant.id, {"max_concurrent_runs": 1}).json()["max_concurrent_runs"] == 1


def test_an_unknown_tenant_is_a_404_in_the_uniform_body(client: TestClient) -> None:
    for tenant_id in ("ten_000000000000", "nope"):
        r = _patch(client, tenant_id, {"max_concurrent_runs": 3})
        assert r.status_code == 404, r.text
        assert set(r.json()) == {"error"}
        assert r.json()["error"]["code"] == "not_found" and tenant_id in r.json()["error"]["message"]
    deleted = new_tenant(client)
    assert client.delete(f"/v1/tenants/{deleted.id}", headers=ADMIN_HEADERS).status_code == 204
    assert _patch(client, deleted.id, {"max_concurrent_runs": 3}).status_code == 404


def test_only_the_admin_key_changes_a_quota(client: TestClient, db: Session) -> None:
    tenant = new_tenant(client, quota=2)
    body = {"max_concurrent_runs": 5}
    r = client.patch(f"/v1/tenants/{tenant.id}", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert _patch(client, tenant.id, body, {"Authorization": "Bearer nope"}).status_code == 401
    r = _patch(client, tenant.id, body, tenant.headers)  # the tenant cannot raise its own quota
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert _patch(client, tenant.id, body, WORKER_HEADERS).status_code == 403
    db.expire_all()
    assert db.scalar(select(Tenant.max_concurrent_runs).where(Tenant.id == tenant.id)) == 2


def test_the_cli_updates_a_quota(live_server: Any) -> None:
    runner = CliRunner()
    env = {"LORALOOM_URL": live_server.url, "LORALOOM_ADMIN_KEY": ADMIN_KEY}
    created = runner.invoke(cli, ["tenants", "create", "acme", "--json"], env=env)
    assert created.exit_code == 0, created.output
    tenant_id = json.loads(created.stdout)["id"]

    text = runner.invoke(cli, ["tenants", "update", tenant_id, "--max-concurrent-runs", "7"], env=env)
    assert text.exit_code == 0, text.output
    assert text.stdout == f"tenant acme: {tenant_id} (quota 7)\n"  # as `tenants create` says it

    as_json = runner.invoke(
        cli, ["tenants", "update", tenant_id, "--max-concurrent-runs", "3", "--json"], env=env
    )
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.stdout) | {"created_at": None} == {
        "id": tenant_id,
        "name": "acme",
        "max_concurrent_runs": 3,
        "created_at": None,
    }

    refused = runner.invoke(
        cli, ["tenants", "update", tenant_id, "--max-concurrent-runs", "0", "--json"], env=env
    )
    assert refused.exit_code != 0 and json.loads(refused.stderr)["error"]["code"] == "validation_error"
    unknown = runner.invoke(
        cli, ["tenants", "update", "ten_000000000000", "--max-concurrent-runs", "3", "--json"], env=env
    )
    assert unknown.exit_code == 3 and json.loads(unknown.stderr)["error"]["code"] == "not_found"
    missing = runner.invoke(cli, ["tenants", "update", tenant_id], env=env)
    assert missing.exit_code == 2 and "--max-concurrent-runs" in missing.output
    bad_id = runner.invoke(cli, ["tenants", "update", "../runs", "--max-concurrent-runs", "3"], env=env)
    assert bad_id.exit_code == 2 and "not a tenant id" in bad_id.output


@pytest.mark.postgres_only
def test_the_quota_change_takes_the_admission_lock_before_the_tenants_row(settings: Settings) -> None:
    """Lock order (app/runs/admission.py): the admission lock, then the tenant's row. A run's creation
    holds the admission lock and then locks its tenant's row; a quota change that locked the row first
    would deadlock with it. Here a transaction holds the admission lock while the change waits for it:
    the tenant's row must still be free (NOWAIT fails at once otherwise)."""
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    holder, watcher = sessions(), sessions()
    try:
        with TestClient(create_app(settings)) as client:
            tenant = new_tenant(client, quota=1)
            first = create_run(client, tenant, name="first")["id"]
            second = create_run(client, tenant, name="second")["id"]
            holder.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADMISSION_LOCK_KEY})
            outcome: dict[str, Any] = {}

            def change() -> None:
                outcome["response"] = _patch(client, tenant.id, {"max_concurrent_runs": 2})

            changing = threading.Thread(target=change)
            changing.start()
            wait_for_a_lock_waiter(watcher, "the quota change (the admission lock)")
            # What create_run does next under the admission lock: lock the tenant's row.
            holder.execute(text("SELECT id FROM tenants WHERE id = :t FOR UPDATE NOWAIT"), {"t": tenant.id})
            holder.commit()
            changing.join(timeout=30)
            assert not changing.is_alive()
            assert outcome["response"].status_code == 200, outcome["response"].text
            assert [_status(client, tenant, r) for r in (first, second)] == ["active", "active"]
    finally:
        holder.close()
        watcher.close()
        engine.dispose()
