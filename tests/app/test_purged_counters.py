"""Prometheus counters read from row counts never go down when the retention purge deletes rows: a
counter that drops reads to Prometheus as a restart, and `rate()` over it jumps by the whole total."""

from datetime import UTC, datetime, timedelta

from fastapi.testclient import TestClient

from app import sweeper
from app.config import Settings
from tests.app.api import TenantHandle, create_run
from tests.app.factories import committed
from tests.app.test_prometheus import scrape, value
from tests.app.test_retention import (
    RUN_RETENTION,
    delete,
    deleted_at,
    factory,
    keep,
    leave_rows,
    settings,
)

__all__ = ["factory", "keep", "settings"]  # the retention tests' fixtures, shared

COUNTERS = (
    "loraloom_runs_created_total",
    "loraloom_batches_ingested_total",
    "loraloom_batch_bytes_ingested_total",
    "loraloom_steps_trained_total",
)


def test_counters_keep_what_the_purge_deleted(
    client: TestClient, tenant: TenantHandle, settings: Settings, keep: Settings, factory
) -> None:
    old = create_run(client, tenant, name="old")["id"]
    with committed(settings) as s:
        leave_rows(s, run_id=old, tenant_id=tenant.id, n=3)  # 3 batches of 1 byte, 3 step reports
    delete(client, tenant, old)
    now = datetime.now(UTC)
    deleted_at(settings, old, now - timedelta(seconds=RUN_RETENTION + 60))
    _, before = scrape(client)
    assert value(before, "loraloom_batches_ingested_total") >= 3

    result = sweeper.sweep_once(factory, settings=keep, now=now)
    assert result.errors == [] and result.purged_runs == [old]
    _, after = scrape(client)
    for name in COUNTERS:
        assert value(after, name) == value(before, name), name

    # And they go on counting from there.
    create_run(client, tenant, name="new")
    _, later = scrape(client)
    assert value(later, "loraloom_runs_created_total") == value(before, "loraloom_runs_created_total") + 1
