"""An uploaded adapter a run still starts from cannot be deleted (a hostile-tenant probe's finding): the
DELETE answered 204 while a queued run had `init_from {adapter_id}`, and once a slot freed the pool
evicted that run ("... has no files", `failure_reason` empty). Now:

- DELETE /v1/adapters/{id} is a 409 `adapter_in_use` naming the runs that may still load it: queued
  ones, and active ones without a checkpoint of their own (a pool restarted before it loads the
  weights again, trainer_core/init_from.py). Once the run has a checkpoint, the upload may go.
- The check is exact against a run created from the adapter at the same moment: the deletion takes
  the tenant's row, which the run's creation holds from before it reads the adapter to its commit.
  The window is held open by a pause point, never by sleeping.
- A run whose `init_from` weights the pool cannot load is `failed`, with the reason as its
  `failure_reason` (POST /v1/pool/runs/{id}/fail), and the service's 404 for a deleted upload says so.
"""

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import delete

from app.adapters import uploads
from app.adapters.models import TenantAdapter
from app.config import Settings
from app.main import create_app
from app.runs import service as runs_service
from tests.app.api import POOL_SPEC, WORKER_HEADERS, TenantHandle, new_tenant, register
from tests.app.factories import committed
from tests.app.test_adapters import _tenant_upload

CONFIG: dict[str, Any] = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
TENSORS = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4),
}
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"]}
WAIT_S = 30
"""How long a pause point waits for the other side (a safety net: each wait ends at an event)."""


def _upload(client: TestClient, tenant: TenantHandle) -> str:
    r = _tenant_upload(client, tenant, CONFIG, TENSORS)
    assert r.status_code == 201, r.text
    adapter_id: str = r.json()["id"]
    return adapter_id


def _create_from(client: TestClient, tenant: TenantHandle, adapter_id: str, name: str = "child") -> Any:
    return client.post(
        "/v1/runs",
        json={"name": name, "config": {"lora": LORA}, "init_from": {"adapter_id": adapter_id}},
        headers=tenant.headers,
    )


def _run(client: TestClient, tenant: TenantHandle, run_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/runs/{run_id}", headers=tenant.headers)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _kept(client: TestClient, tenant: TenantHandle, settings: Settings, adapter_id: str) -> bool:
    listed = client.get(f"/v1/adapters/{adapter_id}", headers=tenant.headers).status_code == 200
    on_disk = (uploads.uploads_dir(settings) / adapter_id / uploads.ARCHIVE).is_file()
    assert listed == on_disk, (listed, on_disk)
    return listed


@pytest.fixture
def pool(client: TestClient) -> None:
    register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)


def test_an_upload_a_run_will_start_from_is_kept_until_the_run_has_a_checkpoint(
    client: TestClient, settings: Settings, pool: None
) -> None:
    tenant = new_tenant(client, quota=1)
    adapter_id = _upload(client, tenant)
    first = client.post("/v1/runs", json={"name": "first"}, headers=tenant.headers).json()
    assert first["status"] == "active"
    queued = _create_from(client, tenant, adapter_id)
    assert queued.status_code == 201, queued.text
    child = queued.json()["id"]
    assert queued.json()["status"] == "queued"  # the tenant's quota is in use

    refused = client.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "adapter_in_use"
    assert error["details"] == {"run_ids": [child], "runs": 1}
    assert child in error["message"] and adapter_id in error["message"]
    assert _kept(client, tenant, settings, adapter_id)

    # Admitted: active, but without a checkpoint of its own a restarted pool loads the upload again.
    evicted = client.post(
        f"/v1/runs/{first['id']}/evict", json={"reason": "make room"}, headers=tenant.headers
    )
    assert evicted.status_code == 200, evicted.text
    assert _run(client, tenant, child)["status"] == "active"
    refused = client.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
    assert refused.status_code == 409 and refused.json()["error"]["details"]["run_ids"] == [child]

    # Its first checkpoint: it resumes from its own weights from now on.
    r = client.post(
        f"/v1/pool/runs/{child}/checkpoints", json={"step": 1, "total_samples": 4}, headers=WORKER_HEADERS
    )
    assert r.status_code == 201, r.text
    assert client.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers).status_code == 204
    assert not _kept(client, tenant, settings, adapter_id)
    assert _run(client, tenant, child)["status"] == "active"


def test_runs_that_left_the_queue_no_longer_hold_the_upload(
    client: TestClient, settings: Settings, pool: None
) -> None:
    tenant = new_tenant(client, quota=1)
    adapter_id = _upload(client, tenant)
    assert (
        client.post("/v1/runs", json={"name": "first"}, headers=tenant.headers).json()["status"] == "active"
    )
    children = [_create_from(client, tenant, adapter_id, name=f"c{i}").json()["id"] for i in range(2)]
    refused = client.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
    assert refused.json()["error"]["details"] == {"run_ids": children, "runs": 2}  # oldest first
    assert client.delete(f"/v1/runs/{children[0]}", headers=tenant.headers).status_code == 200
    r = client.post(
        f"/v1/runs/{children[1]}/evict", json={"reason": "changed my mind"}, headers=tenant.headers
    )
    assert r.status_code == 200, r.text
    assert client.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers).status_code == 204
    assert not _kept(client, tenant, settings, adapter_id)


class _HoldAfter:
    """Wraps `fn`: its first call returns only once `release` is set, signalling `reached` first."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.reached = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        if not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(WAIT_S), "the pause point was never released"
        return out


class _Signal:
    """Wraps `fn`: sets `event` before each call (`after`: once each call has ended)."""

    def __init__(self, fn: Callable[..., Any], event: threading.Event, *, after: bool = False) -> None:
        self.fn, self.event, self.after = fn, event, after

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.after:
            self.event.set()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.event.set()


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def test_a_deletion_racing_a_run_created_from_the_upload_is_refused(
    client: TestClient, settings: Settings, pool: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's creation is held after it found the adapter, before its commit; the deletion comes
    then. Without the tenant's row lock the deletion saw no run (not committed yet): 204, and the run
    was committed with an `init_from` whose files were gone."""
    tenant = new_tenant(client, quota=1)
    adapter_id = _upload(client, tenant)
    assert (
        client.post("/v1/runs", json={"name": "first"}, headers=tenant.headers).json()["status"] == "active"
    )

    held = _HoldAfter(runs_service.resolve_init_from)  # type: ignore[attr-defined]
    monkeypatch.setattr(runs_service, "resolve_init_from", held)
    # The deletion has reached the tenant's row lock, which waits for the creation's (on SQLite: the
    # database's write lock, its first statement), or, without one, has ended.
    deletion_waits = threading.Event()
    monkeypatch.setattr(uploads, "lock_tenant", _Signal(uploads.lock_tenant, deletion_waits))  # type: ignore[attr-defined]
    # SQLite: every transaction holds that lock from its first statement, whatever the service does.
    sqlite = settings.database_url.startswith("sqlite")
    real_delete = uploads.delete_tenant_adapter
    monkeypatch.setattr(
        uploads, "delete_tenant_adapter", _Signal(real_delete, deletion_waits, after=not sqlite)
    )

    creation, created = _in_thread(lambda: _create_from(client, tenant, adapter_id))
    assert held.reached.wait(WAIT_S)
    deletion, deleted = _in_thread(
        lambda: client.delete(f"/v1/adapters/{adapter_id}", headers=tenant.headers)
    )
    assert deletion_waits.wait(WAIT_S)
    held.release.set()
    creation.join(WAIT_S)
    deletion.join(WAIT_S)
    assert not creation.is_alive() and not deletion.is_alive()

    assert created[0].status_code == 201, created[0].text
    child = created[0].json()["id"]
    assert deleted[0].status_code == 409, deleted[0].text
    assert deleted[0].json()["error"]["details"]["run_ids"] == [child]
    assert _kept(client, tenant, settings, adapter_id)


def test_a_run_whose_upload_is_gone_fails_saying_why(
    client: TestClient, settings: Settings, pool: None
) -> None:
    """The files of an upload can still go (its row removed behind the service's back, a lost disk):
    the pool's download is a 404 that says so, and the pool fails the run with it (it evicted the run,
    `failure_reason` empty)."""
    tenant = new_tenant(client, quota=1)
    adapter_id = _upload(client, tenant)
    created = _create_from(client, tenant, adapter_id)
    assert created.status_code == 201 and created.json()["status"] == "active", created.text
    child = created.json()["id"]
    with committed(settings) as db:
        db.execute(delete(TenantAdapter).where(TenantAdapter.id == adapter_id))

    r = client.get(f"/v1/pool/runs/{child}/init-adapter", headers=WORKER_HEADERS)
    assert r.status_code == 404, r.text
    assert r.json()["error"] == {
        "code": "adapter_not_found",
        "message": f"the uploaded adapter {adapter_id} this run starts from was deleted",
        "details": None,
    }
    reason = f"its init_from weights could not be loaded: NotFound: 404 [adapter_not_found] {adapter_id} ..."
    r = client.post(f"/v1/pool/runs/{child}/fail", json={"reason": reason}, headers=WORKER_HEADERS)
    assert r.status_code == 200, r.text
    run = _run(client, tenant, child)
    assert (run["status"], run["failure_reason"], run["eviction_reason"]) == ("failed", reason, None)
    assert run["slot"] is None
    again = client.post(f"/v1/pool/runs/{child}/fail", json={"reason": reason}, headers=WORKER_HEADERS)
    assert again.status_code == 409 and again.json()["error"]["code"] == "invalid_transition", again.text


def test_the_pools_fail_route_needs_the_worker_token(client: TestClient, tenant: TenantHandle) -> None:
    run_id = client.post("/v1/runs", json={"name": "r"}, headers=tenant.headers).json()["id"]
    r = client.post(f"/v1/pool/runs/{run_id}/fail", json={"reason": "x"}, headers=tenant.headers)
    assert r.status_code == 403, r.text
    assert _run(client, tenant, run_id)["status"] != "failed"


def test_another_tenants_runs_do_not_hold_an_upload(settings: Settings) -> None:
    """Runs are matched within the adapter's tenant (an adapter id is the tenant's alone)."""
    with TestClient(create_app(settings)) as client:
        register(client, module_shapes={m: [32, 32] for m in POOL_SPEC["target_modules"]}, num_layers=2)
        owner, other = new_tenant(client), new_tenant(client)
        adapter_id = _upload(client, owner)
        r = _create_from(client, other, adapter_id)
        assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found", r.text
        assert client.delete(f"/v1/adapters/{adapter_id}", headers=owner.headers).status_code == 204
