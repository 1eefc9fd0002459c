"""The API-key cache (app/key_cache.py): a valid key is looked up once per `api_key_cache_seconds`;
a revocation through this process is effective at once, one made elsewhere (another process or
replica, here: the database directly) within the bound, never later."""

from sqlalchemy import update

from app.db import utcnow
from app.key_cache import ApiKeyCache, key_cache
from app.tenants.models import ApiKey
from tests.app.api import ADMIN_HEADERS, new_tenant
from tests.app.factories import committed
from tests.common import FakeClock


def _use_clock(app, ttl: float) -> FakeClock:
    clock = FakeClock()
    app.state.api_key_cache = ApiKeyCache(ttl, clock=clock)
    return clock


def test_revoked_elsewhere_stops_within_the_bound(app, client, settings):
    clock = _use_clock(app, ttl=2.0)
    tenant = new_tenant(client)
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 200  # looked up, cached
    with committed(settings) as session:  # revoked by another replica: this process is not told
        session.execute(update(ApiKey).where(ApiKey.id == tenant.key_id).values(revoked_at=utcnow()))
    clock.now = 1.9
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 200  # within the bound
    clock.now = 2.0
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 401  # the bound passed
    clock.now = 100.0
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 401  # never cached again


def test_revoked_through_this_process_stops_at_once(app, client):
    _use_clock(app, ttl=60.0)
    tenant = new_tenant(client)
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 200
    r = client.delete(f"/v1/tenants/{tenant.id}/keys/{tenant.key_id}", headers=ADMIN_HEADERS)
    assert r.status_code == 204
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 401


def test_zero_disables_the_cache_and_bad_keys_are_never_cached(app, client, settings):
    _use_clock(app, ttl=0.0)
    tenant = new_tenant(client)
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 200
    with committed(settings) as session:
        session.execute(update(ApiKey).where(ApiKey.id == tenant.key_id).values(revoked_at=utcnow()))
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 401  # no cache: at once
    cache = key_cache(app.state, 0.0)
    assert cache._entries == {}
    assert client.get("/v1/runs", headers={"Authorization": "Bearer llk_wrong"}).status_code == 401
    assert cache._entries == {}
