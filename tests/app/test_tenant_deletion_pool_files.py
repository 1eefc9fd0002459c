"""A tenant's deletion removes its runs' rows (ON DELETE CASCADE), and a pool with its own checkpoint
directory learns of deleted runs only by asking (`POST /v1/pool/runs/deleted`, trainer_core.run_files):
the ids of the runs deleted with their tenant are kept (app/tenants/removal.py), so the answer names
them and the pool removes their files. The kept ids are bounded: they go when a deleted run's own row
would (`deleted_run_retention_seconds`, app/retention.py)."""

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from app import sweeper
from app.config import Settings
from app.db import make_engine, make_session_factory
from app.runs.models import Run
from app.tenants import removal
from app.tenants.models import DeletedRunId
from tests.app.api import ADMIN_HEADERS, WORKER_HEADERS, TenantHandle, create_run, new_tenant
from tests.app.factories import committed, end_read
from trainer_core.run_files import RunFiles

ROUTE = "/v1/pool/runs/deleted"
DAY = 86_400.0


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Slots to spare; the app's own sweeper purges nothing (the tests sweep with `keep`)."""
    return settings.model_copy(update={"max_concurrent_runs": 4, "deleted_run_retention_seconds": 0})


def _deleted(client: TestClient, run_ids: list[str]) -> list[str]:
    r = client.post(ROUTE, json={"run_ids": run_ids}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    deleted: list[str] = r.json()["deleted"]
    return deleted


def _runs_of_every_kind(client: TestClient, tenant: TenantHandle) -> list[str]:
    """Active, queued, evicted and (already) deleted runs of the tenant (quota 2)."""
    active = [create_run(client, tenant, name=f"active{i}")["id"] for i in range(2)]
    queued = create_run(client, tenant, name="queued")["id"]
    r = client.post(f"/v1/runs/{active[1]}/evict", json={"reason": "done"}, headers=tenant.headers)
    assert r.status_code == 200, r.text  # evicted; `queued` takes its place
    deleted = create_run(client, tenant, name="deleted")["id"]
    assert client.delete(f"/v1/runs/{deleted}", headers=tenant.headers).status_code == 200
    return sorted([*active, queued, deleted])


def test_the_runs_of_a_deleted_tenant_are_named_as_deleted(client: TestClient, db: Session) -> None:
    tenant = new_tenant(client, quota=2)
    other = new_tenant(client, quota=2)
    runs = _runs_of_every_kind(client, tenant)
    others = create_run(client, other, name="theirs")["id"]
    before = _deleted(client, [*runs, others])
    assert len(before) == 1 and before[0] in runs  # only the run deleted on its own, so far

    assert client.delete(f"/v1/tenants/{tenant.id}", headers=ADMIN_HEADERS).status_code == 204
    assert db.scalar(select(func.count()).select_from(Run).where(Run.id.in_(runs))) == 0  # rows gone
    end_read(db)
    assert _deleted(client, [*runs, others, "run_00000000beef"]) == runs
    assert _deleted(client, [others]) == []  # another tenant's live run is untouched


def test_the_pool_removes_the_files_of_a_deleted_tenants_runs(client: TestClient, tmp_path: Path) -> None:
    """End to end with the pool's housekeeping: its checkpoint home held the tenant's runs' files."""
    tenant = new_tenant(client, quota=2)
    other = new_tenant(client, quota=2)
    runs = _runs_of_every_kind(client, tenant)
    kept = create_run(client, other, name="theirs")["id"]
    home = tmp_path / "pool-checkpoints"
    for run_id in [*runs, kept]:
        (home / run_id / "checkpoints" / "step_1").mkdir(parents=True)

    class Service:
        def deleted_runs(self, run_ids: list[str]) -> set[str]:
            return set(_deleted(client, run_ids))

    files = RunFiles(home, Service())
    assert client.delete(f"/v1/tenants/{tenant.id}", headers=ADMIN_HEADERS).status_code == 204
    assert sorted(files.start()) == runs
    assert sorted(p.name for p in home.iterdir() if not p.name.startswith(".")) == [kept]


@pytest.fixture
def factory(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def test_the_kept_ids_go_after_the_deleted_runs_retention(
    client: TestClient, settings: Settings, factory: sessionmaker[Session]
) -> None:
    tenant = new_tenant(client, quota=2)
    runs = _runs_of_every_kind(client, tenant)
    assert client.delete(f"/v1/tenants/{tenant.id}", headers=ADMIN_HEADERS).status_code == 204
    keep = settings.model_copy(update={"deleted_run_retention_seconds": 7 * DAY})
    now = datetime.now(UTC)

    # Within the retention: kept, and still named.
    result = sweeper.sweep_once(factory, settings=keep, now=now + timedelta(days=6))
    assert result.errors == [] and result.purged_run_rows == 0
    assert _deleted(client, runs) == runs

    # Past it: gone, a chunk at a time, as a deleted run's row goes; one deleted later stays.
    later = runs[0]
    with committed(settings) as s:
        s.execute(
            update(DeletedRunId)
            .where(DeletedRunId.run_id == later)
            .values(deleted_at=now + timedelta(days=2))
        )
    result = sweeper.sweep_once(factory, settings=keep, now=now + timedelta(days=7, seconds=1), purge_chunk=2)
    assert result.errors == [] and result.purged_run_rows == len(runs) - 1
    assert _deleted(client, runs) == [later]
    with committed(settings) as s:
        assert list(s.scalars(select(DeletedRunId.run_id))) == [later]


def test_a_rolled_back_tenant_deletion_keeps_no_ids(
    client: TestClient, monkeypatch: pytest.MonkeyPatch, settings: Settings
) -> None:
    """The ids are written in the deletion's transaction: a deletion that fails keeps the runs, and
    names none of them as deleted."""
    tenant = new_tenant(client, quota=2)
    run_id = create_run(client, tenant, name="live")["id"]

    def fail(*_args: object) -> None:
        raise RuntimeError("the deletion fails after the ids were written")

    monkeypatch.setattr(removal, "call_after_commit", fail)
    r = client.delete(f"/v1/tenants/{tenant.id}", headers=ADMIN_HEADERS)
    assert r.status_code == 500, r.text
    assert _deleted(client, [run_id]) == []
    assert client.get(f"/v1/runs/{run_id}", headers=tenant.headers).json()["status"] == "active"
    with committed(settings) as s:
        assert s.scalar(select(func.count()).select_from(DeletedRunId)) == 0
