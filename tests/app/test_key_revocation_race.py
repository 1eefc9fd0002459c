"""A request that read a key as valid just before the key was revoked through this process must not
put it in the cache after the revocation cleared it: it was trusted for a whole
`api_key_cache_seconds` more (a probe saw a revoked key work ~2 s later in 6 of 8 tries). The window
is made deterministic: the revocation runs inside the request's key lookup, after its read."""

from typing import Any

from sqlalchemy.orm import Session

from app import request_guard
from app.auth import hash_key, known_key
from app.key_cache import ApiKeyCache, key_cache
from app.ttl_cache import TtlCache
from tests.app.api import ADMIN_HEADERS, new_tenant
from tests.common import FakeClock


def test_a_stale_read_is_not_cached_after_a_clear() -> None:
    cache: TtlCache[str, int] = TtlCache(60.0, clock=FakeClock())
    before = cache.generation
    cache.clear()
    cache.put("k", 1, read_in=before)
    assert cache.get("k") is None
    cache.put("k", 2, read_in=cache.generation)
    assert cache.get("k") == 2


def test_a_lookup_racing_a_revocation_does_not_cache_the_key(app, client, settings, monkeypatch) -> None:
    app.state.api_key_cache = ApiKeyCache(60.0, clock=FakeClock())
    tenant = new_tenant(client)
    digest = hash_key(tenant.key)
    real_scalar = Session.scalar

    def scalar_then_revoke(self: Session, *args: Any, **kwargs: Any) -> Any:
        row = real_scalar(self, *args, **kwargs)  # the request reads the key: still valid
        monkeypatch.setattr(Session, "scalar", real_scalar)
        self.expunge(row)  # keeps what was read; the read ends (SQLite: it would hold off the write)
        self.rollback()
        r = client.delete(f"/v1/tenants/{tenant.id}/keys/{tenant.key_id}", headers=ADMIN_HEADERS)
        assert r.status_code == 204  # committed and the cache cleared, between the read and the put
        return row

    monkeypatch.setattr(Session, "scalar", scalar_then_revoke)
    with app.state.session_factory() as session:
        found = known_key(app.state, session, digest)  # this request was admitted before the revoke
    assert found.api_key_id == tenant.key_id
    assert key_cache(app.state, settings.api_key_cache_seconds).get(digest) is None
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 401


def test_the_request_guards_lookup_racing_a_revocation_does_not_cache_the_key(
    app, client, settings, monkeypatch
) -> None:
    """The same window in the request guard's own lookup (a large body's key, looked up before the
    body is read: app/request_guard.py `_tenant_key_credential`), which caches what it found too."""
    app.state.api_key_cache = ApiKeyCache(60.0, clock=FakeClock())
    tenant = new_tenant(client)
    digest = hash_key(tenant.key)
    real_execute = Session.execute

    class Read:
        def __init__(self, row: Any) -> None:
            self.row = row

        def first(self) -> Any:
            return self.row

    def execute_then_revoke(self: Session, *args: Any, **kwargs: Any) -> Any:
        row = real_execute(self, *args, **kwargs).first()  # the guard reads the key: still valid
        monkeypatch.setattr(Session, "execute", real_execute)
        self.rollback()  # the read ends (SQLite: it would hold off the write)
        r = client.delete(f"/v1/tenants/{tenant.id}/keys/{tenant.key_id}", headers=ADMIN_HEADERS)
        assert r.status_code == 204  # committed and the cache cleared, between the read and the put
        return Read(row)

    monkeypatch.setattr(Session, "execute", execute_then_revoke)
    credential = request_guard._tenant_key_credential(app.state, digest)
    assert credential.tenant_id == tenant.id  # admitted: it read the key before the revocation
    assert key_cache(app.state, settings.api_key_cache_seconds).get(digest) is None
    assert client.get("/v1/runs", headers=tenant.headers).status_code == 401
