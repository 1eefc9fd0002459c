"""Deleting a tenant locks its row (`app.tenants.service.lock_tenant`) before its runs' rows. A
transaction that holds a run row and then inserts a row referencing the tenant (a batch's event, a
Tinker future: Postgres takes FOR KEY SHARE on the tenant for the foreign key) must not deadlock
with it: the lock is FOR NO KEY UPDATE, which KEY SHARE passes. With FOR UPDATE the holder waited
for the deletion, which waited for the holder's run row, until Postgres aborted one of them."""

import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from app.db import make_engine, make_session_factory
from app.main import create_app
from tests.app.api import ADMIN_HEADERS
from tests.app.factories import seed_run
from tests.common import wait_for_a_lock_waiter

pytestmark = pytest.mark.postgres_only


def test_a_run_holder_referencing_the_tenant_does_not_deadlock_its_deletion(settings) -> None:
    seeded = seed_run(settings)
    engine = make_engine(settings.database_url)
    sessions = make_session_factory(engine)
    holder, watcher = sessions(), sessions()
    try:
        # The holder: a run row locked, as a batch submission holds it until its commit.
        holder.execute(text("SELECT id FROM runs WHERE id = :r FOR UPDATE"), {"r": seeded.run_id})
        outcome: dict[str, int] = {}
        with TestClient(create_app(settings)) as client:

            def delete() -> None:
                r = client.delete(f"/v1/tenants/{seeded.tenant_id}", headers=ADMIN_HEADERS)
                outcome["status"] = r.status_code

            deleting = threading.Thread(target=delete)
            deleting.start()
            wait_for_a_lock_waiter(watcher, "the deletion (the run's row)")
            # The deletion holds the tenant's row and waits for the run's. Now the holder takes what
            # a foreign key check takes on the tenant: with FOR UPDATE on it, a deadlock.
            holder.execute(
                text("SELECT id FROM tenants WHERE id = :t FOR KEY SHARE"), {"t": seeded.tenant_id}
            )
            holder.commit()
            deleting.join(timeout=30)
            assert not deleting.is_alive()
        assert outcome["status"] == 204
    finally:
        holder.close()
        watcher.close()
        engine.dispose()
