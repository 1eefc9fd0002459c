"""The batch route's cache of the runs it reads (app/batches/ingest_run.py): an active run's config
and its pool's vocabulary are trusted for `ingest_run_cache_seconds`, never longer; a run that left
meanwhile (evicted, deleted with its tenant, trained past the batch) takes no batch and stores
nothing, and a retry of a batch it accepted before it left still gets that batch."""

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, update

from app.batches.ingest_run import IngestRunCache
from app.key_cache import ApiKeyCache
from app.main import create_app
from app.pools.models import Pool
from app.runs.models import Run
from app.tenants.models import Tenant
from tests.app.api import batch_body, post_batch
from tests.app.factories import Seeded, add_pool, batch_count, committed, rollout_files, seed_run
from tests.common import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cached_app(settings, clock) -> Any:
    """An app whose key cache holds keys for a minute and whose run cache holds runs for 2 s of `clock`."""
    app = create_app(settings)
    app.state.api_key_cache = ApiKeyCache(60.0)
    app.state.ingest_run_cache = IngestRunCache(2.0, clock=clock)
    return app


def _cached(app: Any, seeded: Seeded) -> bool:
    return app.state.ingest_run_cache.get((seeded.tenant_id, seeded.run_id)) is not None


def _evict_elsewhere(settings, run_id: str) -> None:
    """Evicted by another replica (or the pool): this process is not told."""
    with committed(settings) as session:
        session.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(status="evicted", eviction_reason="by another replica", evicted_by="user")
        )


def test_a_pools_vocabulary_is_trusted_within_the_bound_never_later(settings, cached_app, clock, fast_calls):
    pool_id = add_pool(settings, vocab_size=1000)
    seeded = seed_run(settings)
    out_of_new_vocab = batch_body(1, seed=1)
    out_of_new_vocab["examples"][0]["completion_ids"] = [1, 2, 500]
    with TestClient(cached_app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201  # caches the key
        assert post_batch(client, seeded, batch_body(1, seed=2)).status_code == 201  # reads, caches the run
        assert _cached(cached_app, seeded)
        with committed(settings) as session:  # the pool re-registers with a smaller vocabulary
            session.execute(update(Pool).where(Pool.id == pool_id).values(vocab_size=100))
        clock.now = 1.9
        assert post_batch(client, seeded, out_of_new_vocab).status_code == 201  # within the bound
        clock.now = 2.0
        r = post_batch(client, seeded, out_of_new_vocab)  # the bound passed: read again
        assert r.status_code == 422
        assert r.json()["error"]["details"][0]["field"] == "completion_ids"
    assert len(fast_calls) == 3  # all but the first (the key was not cached yet)
    assert batch_count(settings) == 3 and len(rollout_files(settings)) == 3


def test_a_run_evicted_behind_the_cache_takes_no_batch(settings, cached_app, fast_calls):
    seeded = seed_run(settings)
    with TestClient(cached_app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201
        assert post_batch(client, seeded, batch_body(1, seed=1)).status_code == 201
        assert _cached(cached_app, seeded)
        _evict_elsewhere(settings, seeded.run_id)
        r = post_batch(client, seeded, batch_body(1, seed=2))  # refused under the run's row lock
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "run_evicted"
        assert r.json()["error"]["details"]["reason"] == "by another replica"
        assert not _cached(cached_app, seeded)  # the next request reads the run again
        r = post_batch(client, seeded, batch_body(1, seed=3))
        assert r.status_code == 409 and r.json()["error"]["code"] == "run_evicted"
        assert not _cached(cached_app, seeded)  # left runs are never cached
    assert len(fast_calls) == 3
    assert batch_count(settings) == 2 and len(rollout_files(settings)) == 2  # the refused files are gone
    with committed(settings) as session:
        run = session.get_one(Run, seeded.run_id)
        assert run.submitted_samples == 2  # the refused reservations were rolled back


def test_a_retry_of_an_accepted_batch_gets_it_after_the_run_left(settings, cached_app):
    seeded = seed_run(settings)
    body = batch_body(2, seed=7)
    with TestClient(cached_app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201
        first = post_batch(client, seeded, body, key="retry-me")
        assert first.status_code == 201
        _evict_elsewhere(settings, seeded.run_id)
        assert _cached(cached_app, seeded)
        again = post_batch(client, seeded, body, key="retry-me")  # the cache still says active
        assert again.status_code == 200
        assert again.json()["id"] == first.json()["id"]
        assert not _cached(cached_app, seeded)  # a replay drops the entry: the run may have left
        other = post_batch(client, seeded, batch_body(2, seed=8), key="retry-me")  # another body
        assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    assert batch_count(settings) == 2 and len(rollout_files(settings)) == 2


def test_a_stale_batch_is_refused_under_the_lock_when_the_cached_step_is_old(settings, cached_app):
    seeded = seed_run(settings)
    with TestClient(cached_app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201
        assert post_batch(client, seeded, batch_body(1, seed=1)).status_code == 201  # cached at step 0
        with committed(settings) as session:  # the pool trained on
            session.execute(update(Run).where(Run.id == seeded.run_id).values(step=5))
        r = post_batch(client, seeded, batch_body(1, seed=2, step=0))  # max_async_level is 2
        assert r.status_code == 409 and r.json()["error"]["code"] == "stale_batch"
        assert r.json()["error"]["details"]["run_step"] == 5
        assert not _cached(cached_app, seeded)
        assert post_batch(client, seeded, batch_body(1, seed=3, step=4)).status_code == 201
    assert batch_count(settings) == 3 and len(rollout_files(settings)) == 3


def test_a_run_deleted_with_its_tenant_behind_both_caches_is_a_404(settings, cached_app):
    seeded = seed_run(settings)
    with TestClient(cached_app) as client:
        assert post_batch(client, seeded, batch_body(1)).status_code == 201
        assert post_batch(client, seeded, batch_body(1, seed=1)).status_code == 201
        with committed(settings) as session:  # deleted through another replica: rows cascade
            session.execute(delete(Tenant).where(Tenant.id == seeded.tenant_id))
        r = post_batch(client, seeded, batch_body(1, seed=2))  # the key is still trusted here
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert not _cached(cached_app, seeded)
    # The rows went behind the service's back, so no deletion of the run's directory followed; the
    # refusal that found no run row removes it (the start-up rebuild would, as a stray directory).
    assert batch_count(settings) == 0 and rollout_files(settings) == []


def test_zero_seconds_reads_the_run_with_every_batch(settings, fast_calls):
    app = create_app(settings.model_copy(update={"ingest_run_cache_seconds": 0.0}))
    app.state.api_key_cache = ApiKeyCache(60.0)
    seeded = seed_run(settings)
    with TestClient(app) as client:
        for seed in range(3):
            assert post_batch(client, seeded, batch_body(1, seed=seed)).status_code == 201
    assert len(fast_calls) == 2
    assert app.state.ingest_run_cache._entries == {}
