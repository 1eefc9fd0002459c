"""retrieve_future of a future whose result names a deleted model: a save's (its `tinker://` path),
the model's creation, a load into it. It answered 200 with that result until the retention purge
took the future, while every read of the model (tests/app/test_tinker_deleted_models.py) and every
call on its paths (tests/app/test_tinker_deleted_run_paths.py) already said 404: the SDK handed the
user a path that loads, resolves and samples nothing. It is now the 404 every read of a deleted
model answers; a failed future still says why it failed, the other completed work keeps its result,
and an evicted model's futures answer as before. By hand and through the official SDK (pinned,
unmodified, under uvicorn, its poll held at a pause point while the model's run is deleted); both
databases."""

import re
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import tinker
from fastapi.testclient import TestClient
from starlette.requests import Request

from app.tinker import router
from tests.app.api import Client, TenantHandle, new_tenant, register
from tests.app.tinker_calls import BASE_MODEL, answer_work, new_session, run_of, tinker_headers


def _not_found(r: Any, model_id: str) -> None:
    """The body the service answers for a model it does not know (or whose run is deleted)."""
    assert r.status_code == 404, r.text
    assert r.json() == {
        "error": {"code": "not_found", "message": f"model {model_id} not found", "details": None}
    }


def _retrieve(client: Client, tenant: TenantHandle, request_id: str) -> Any:
    """The raw answer (a TestClient's or an httpx client's response)."""
    return client.post(
        "/api/v1/retrieve_future", json={"request_id": request_id}, headers=tinker_headers(tenant)
    )


def _submitted(client: Client, tenant: TenantHandle, route: str, body: dict[str, Any]) -> str:
    r = client.post(f"/api/v1/{route}", json=body, headers=tinker_headers(tenant))
    assert r.status_code == 200, r.text
    request_id: str = r.json()["request_id"]
    return request_id


def _created(client: Client, tenant: TenantHandle) -> tuple[str, str]:
    """A new model (rank 4, attention only): (its id, the request id of its creation)."""
    body = {
        "session_id": new_session(client, tenant),
        "model_seq_id": 0,
        "base_model": BASE_MODEL,
        "lora_config": {"rank": 4, "train_unembed": False, "train_mlp": False},
    }
    r = client.post("/api/v1/create_model", json=body, headers=tinker_headers(tenant))
    assert r.status_code == 200, r.text
    return str(r.json()["model_id"]), str(r.json()["request_id"])


def _save(client: Client, tenant: TenantHandle, model_id: str, seq_id: int, route: str, name: str) -> str:
    return _submitted(client, tenant, route, {"model_id": model_id, "seq_id": seq_id, "path": name})


def test_a_deleted_models_saves_creation_and_loads_answer_the_unknown_models_404(client: TestClient) -> None:
    tenant = new_tenant(client, quota=3)  # three models, each a run active at once
    pool_id = register(client, slots=3)
    model_id, created = _created(client, tenant)
    step = _submitted(
        client,
        tenant,
        "optim_step",
        {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}},
    )
    state = _save(client, tenant, model_id, 2, "save_weights", "st")
    sampler = _save(client, tenant, model_id, 3, "save_weights_for_sampler", "sm")
    assert [i["kind"] for i in answer_work(client, pool_id)] == ["optim_step"]  # a step ends a claim
    assert [i["kind"] for i in answer_work(client, pool_id)] == ["save_weights", "save_weights_for_sampler"]
    # A model loaded from the deleted one's state lives on: its load names it, not the source.
    load = {
        "path": f"tinker://{model_id}/weights/st",
        "session_id": new_session(client, tenant),
        "model_seq_id": 0,
    }
    loaded = _submitted(client, tenant, "load_weights", load)
    assert [i["kind"] for i in answer_work(client, pool_id)] == ["load_weights"]
    # Another model, evicted: only deletion hides a model.
    evicted_id, _ = _created(client, tenant)
    evicted_save = _save(client, tenant, evicted_id, 1, "save_weights_for_sampler", "kept")
    assert [i["kind"] for i in answer_work(client, pool_id)] == ["save_weights_for_sampler"]
    pending = _save(client, tenant, model_id, 4, "save_weights_for_sampler", "late")  # never claimed

    before = {rid: _retrieve(client, tenant, rid) for rid in (created, state, sampler, evicted_save)}
    assert {rid: r.status_code for rid, r in before.items()} == dict.fromkeys(before, 200)
    assert before[state].json() == {"path": f"tinker://{model_id}/weights/st", "type": "save_weights"}
    assert before[sampler].json()["path"] == f"tinker://{model_id}/sampler_weights/sm"

    evict = client.post(
        f"/v1/runs/{run_of(client, tenant, evicted_id)}/evict",
        json={"reason": "done"},
        headers=tenant.headers,
    )
    assert evict.status_code == 200, evict.text
    deleted = client.delete(f"/v1/runs/{run_of(client, tenant, model_id)}", headers=tenant.headers)
    assert deleted.status_code == 200, deleted.text

    # What names the deleted model: the unknown model's 404, the retrieve retried the same.
    for request_id in (created, state, sampler, created):
        _not_found(_retrieve(client, tenant, request_id), model_id)
    # A pending save fails with the reason its run left (a client still driving it learns why).
    failed = _retrieve(client, tenant, pending)
    assert failed.status_code == 200, failed.text
    assert failed.json()["category"] == "user" and "left (deleted)" in failed.json()["error"], failed.text
    # Its other completed work keeps its result: numbers computed, nothing gone named.
    kept_step = _retrieve(client, tenant, step)
    assert kept_step.status_code == 200 and kept_step.json()["metrics"]["step"] == 1.0, kept_step.text
    # The model loaded from its state, and the evicted model's save, answer as before.
    loaded_answer = _retrieve(client, tenant, loaded)
    assert loaded_answer.status_code == 200, loaded_answer.text
    assert loaded_answer.json()["model_id"] == f"{load['session_id']}:train:0"
    assert _retrieve(client, tenant, evicted_save).json() == before[evicted_save].json()
    # Another tenant still learns nothing of the request.
    other = new_tenant(client)
    assert _retrieve(client, other, state).json()["error"]["message"].startswith(f"request {state} not found")


class Gate:
    """A pause point in retrieve_future's check (`router._retrieve_once`): a check waits at it
    until `opened` is set, and says it arrived (`arrived`) with the request id it checks."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.arrived = threading.Event()
        self.opened = threading.Event()
        self.request_ids: list[str] = []

    def __call__(self, factory: Any, *, request: Request, request_id: str) -> Any:
        self.request_ids.append(request_id)
        self.arrived.set()
        self.opened.wait()  # the test opens it, at the latest when it ends
        return self.real(factory, request=request, request_id=request_id)


def test_the_sdks_save_raises_when_its_model_was_deleted_before_its_result_was_read(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save completes and the model's run is deleted while the SDK's poll waits at the gate:
    its `result()` raises the 404 (the SDK retries none), where it returned the dead path."""
    tenant = new_tenant(http, quota=2)
    pool_id = register(http)
    service = tinker.ServiceClient(base_url=str(http.base_url), api_key="tml-" + tenant.key)
    gate = Gate(router._retrieve_once)
    try:
        training = service.create_lora_training_client(
            BASE_MODEL, rank=4, train_unembed=False, train_mlp=False
        ).result()
        monkeypatch.setattr(router, "_retrieve_once", gate)
        saving = training.save_weights_for_sampler("final")
        assert gate.arrived.wait(timeout=30), "the SDK never polled its save"
        assert [i["kind"] for i in answer_work(http, pool_id)] == ["save_weights_for_sampler"]
        run_id = run_of(http, tenant, training.model_id)
        assert http.delete(f"/v1/runs/{run_id}", headers=tenant.headers).status_code == 200
        gate.opened.set()
        with pytest.raises(ValueError, match=re.escape(f"model {training.model_id} not found")) as raised:
            saving.result(timeout=30)
        assert "status 404" in str(raised.value), raised.value
        (request_id,) = set(gate.request_ids)
        _not_found(_retrieve(http, tenant, request_id), training.model_id)
    finally:
        gate.opened.set()
        service.close("success").result()
