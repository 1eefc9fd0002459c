"""Live sampler checkpoints are bounded per tenant (`tinker_max_sampler_checkpoints_per_tenant`):
every `save_weights_for_sampler` under a new name pinned its adapter step from the pruning and kept
a copy on the pool's disk, with no limit, so a tenant saving in a loop pinned steps without end.
Past the bound a save is the 403 `save_quota` of saved training states (the official SDK retries a
409 or 429 of a submission for 5 minutes: tests/app/test_tinker_retry_hints.py), naming the bound
and how to free a place, and nothing is stored. Deleting a sampler checkpoint frees its place.
"""

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import tinker
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.config import Settings
from app.main import create_app
from app.tinker import checkpoints
from app.tinker.models import TinkerFuture
from tests.app.api import LiveServer, TenantHandle, new_tenant, register
from tests.app.tinker_calls import AnsweringPool, answer_work, new_model, run_of, tinker_headers
from tests.common import wait_for_a_lock_waiter

MOST = 3
SETTING = "LORALOOM_TINKER_MAX_SAMPLER_CHECKPOINTS_PER_TENANT"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"tinker_max_sampler_checkpoints_per_tenant": MOST})


def _save(
    http: Any,
    model_id: str,
    tenant: TenantHandle,
    seq_id: int,
    name: str,
    kind: str = "save_weights_for_sampler",
) -> Any:
    body = {"model_id": model_id, "seq_id": seq_id, "path": name}
    return http.post(f"/api/v1/{kind}", json=body, headers=tinker_headers(tenant))


def _sampler_saves(db: Session) -> int:
    db.expire_all()
    saves = (
        select(func.count()).select_from(TinkerFuture).where(TinkerFuture.kind == "save_weights_for_sampler")
    )
    n = int(db.scalar(saves) or 0)
    db.rollback()  # ends the transaction: on SQLite it holds the database's write lock
    return n


def _refused(r: Any, kept: int) -> None:
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "save_quota"
    assert error["details"] == {"kind": "sampler_checkpoints", "kept": kept, "limit": MOST}
    assert f"{SETTING} = {MOST}" in error["message"]
    assert "delete one to free its place" in error["message"]


def test_a_tenant_keeps_at_most_its_live_sampler_checkpoints(
    client: TestClient, tenant: TenantHandle, db: Session
) -> None:
    pool_id = register(client)
    model_id = new_model(client, tenant)
    for seq_id, name in enumerate(["s0", "s1"], start=1):
        assert _save(client, model_id, tenant, seq_id, name).status_code == 200
    assert len(answer_work(client, pool_id)) == 2
    # One more pending (not yet run by the pool): it counts, as it will be live once run.
    assert _save(client, model_id, tenant, 3, "s2").status_code == 200

    _refused(_save(client, model_id, tenant, 4, "s3"), kept=MOST)
    assert _sampler_saves(db) == MOST  # nothing stored

    # A live name saved again replaces it (its path names the newest save only): always room.
    assert _save(client, model_id, tenant, 4, "s0").status_code == 200
    # Training states are not sampler checkpoints: their own quota.
    assert _save(client, model_id, tenant, 5, "st", kind="save_weights").status_code == 200
    # Another tenant has its own bound.
    other = new_tenant(client)
    assert _save(client, new_model(client, other), other, 1, "s3").status_code == 200
    answer_work(client, pool_id)

    # Deleting a sampler checkpoint (the Tinker delete route) frees its place.
    gone = client.delete(
        f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/s1", headers=tinker_headers(tenant)
    )
    assert gone.status_code == 204, gone.text
    assert _save(client, model_id, tenant, 6, "s3").status_code == 200
    _refused(_save(client, model_id, tenant, 7, "s4"), kept=MOST)


def test_a_deleted_runs_sampler_checkpoints_do_not_count(client: TestClient, tenant: TenantHandle) -> None:
    pool_id = register(client)
    model_id = new_model(client, tenant)
    for seq_id in range(1, MOST + 1):
        assert _save(client, model_id, tenant, seq_id, f"s{seq_id}").status_code == 200
    answer_work(client, pool_id)
    _refused(_save(client, model_id, tenant, MOST + 1, "new"), kept=MOST)
    assert (
        client.delete(f"/v1/runs/{run_of(client, tenant, model_id)}", headers=tenant.headers).status_code
        == 200
    )
    fresh = new_model(client, tenant)
    assert _save(client, fresh, tenant, 1, "s1").status_code == 200


@pytest.fixture
def one_place(settings: Settings) -> Iterator[tuple[LiveServer, httpx.Client]]:
    """The app under uvicorn with a bound of one live sampler checkpoint."""
    app = create_app(settings.model_copy(update={"tinker_max_sampler_checkpoints_per_tenant": 1}))
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        yield server, http


def test_past_the_bound_the_sdk_raises_at_once_and_a_deletion_makes_room(
    one_place: tuple[LiveServer, httpx.Client], db: Session
) -> None:
    server, http = one_place
    tenant = new_tenant(http)
    pool_id = register(http)
    service = tinker.ServiceClient(base_url=server.url, api_key="tml-" + tenant.key)
    rest = tinker.RestClient(base_url=server.url, api_key="tml-" + tenant.key)
    try:
        with AnsweringPool(server.url, pool_id):
            training = service.create_lora_training_client(
                "loraloom-tiny", rank=4, train_mlp=False, train_unembed=False
            ).result()
            first = training.save_weights_for_sampler("first").result(timeout=30)
            with pytest.raises(tinker.PermissionDeniedError) as refused:
                training.save_weights_for_sampler("second").result(timeout=15)
            assert _sampler_saves(db) == 1  # nothing stored

            rest.delete_checkpoint_from_tinker_path(first.path).result()
            second = training.save_weights_for_sampler("second").result(timeout=30)
    finally:
        service.close("success").result()
    assert refused.value.status_code == 403
    assert f"{SETTING} = 1" in str(refused.value)
    assert isinstance(refused.value.body, dict) and refused.value.body["error"]["code"] == "save_quota"
    assert second.path == f"tinker://{training.model_id}/sampler_weights/second"
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [second.path]


@pytest.mark.postgres_only
def test_two_saves_at_once_cannot_both_take_the_last_place(
    one_place: tuple[LiveServer, httpx.Client], db: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first save counts under the tenant's row lock and holds it to its commit; the second,
    sent meanwhile, waits for that lock, then counts the first's save. The window is held open: the
    first pauses after its count, until the second is seen waiting for a lock. Without the lock both
    counted none and both were stored."""
    _, http = one_place
    tenant = new_tenant(http)
    model_id = new_model(http, tenant)
    real = checkpoints.check_sampler_quota
    counted, go = threading.Event(), threading.Event()
    calls: list[str] = []

    def pause_after_the_first_count(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        calls.append(kwargs["path"])
        if len(calls) == 1:
            counted.set()
            assert go.wait(30)

    monkeypatch.setattr(checkpoints, "check_sampler_quota", pause_after_the_first_count)
    answers: dict[str, httpx.Response] = {}

    def save(seq_id: int, name: str) -> None:
        answers[name] = _save(http, model_id, tenant, seq_id, name)

    first = threading.Thread(target=save, args=(1, "a"))
    second = threading.Thread(target=save, args=(2, "b"))
    first.start()
    assert counted.wait(30)
    second.start()
    try:
        wait_for_a_lock_waiter(db, "the second save (the tenant's row)")
    finally:
        go.set()
        first.join(30)
        second.join(30)
    assert answers["a"].status_code == 200, answers["a"].text
    assert answers["b"].status_code == 403, answers["b"].text
    assert answers["b"].json()["error"]["details"] == {"kind": "sampler_checkpoints", "kept": 1, "limit": 1}
    assert _sampler_saves(db) == 1
