"""A Tinker model whose run is deleted is gone for every read of it: GET /api/v1/training_runs/{id}
(also what `get_training_run_by_tinker_path` asks), its checkpoint listing and get_info answered
200 until the retention purge removed the model's row, while the listings already left it out and
its saved paths were already 404s (tests/app/test_tinker_deleted_run_paths.py). Each is now the 404
an unknown model gets, in the uniform error body; an evicted model still reads as before. Through
the official SDK (pinned, unmodified) under uvicorn, and the raw bodies; both databases."""

from typing import Any

import httpx
import pytest
import tinker

from tests.app.api import TenantHandle, new_tenant
from tests.app.tinker_calls import BASE_MODEL, run_of, tinker_headers


def _not_found(r: httpx.Response, model_id: str) -> None:
    """The body the service answers for a model it does not know."""
    assert r.status_code == 404, r.text
    assert r.json() == {
        "error": {"code": "not_found", "message": f"model {model_id} not found", "details": None}
    }


def _reads(http: httpx.Client, tenant: TenantHandle, model_id: str) -> list[httpx.Response]:
    """Every per-model read of the Tinker surface, by hand."""
    headers = tinker_headers(tenant)
    return [
        http.get(f"/api/v1/training_runs/{model_id}", headers=headers),
        http.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers=headers),
        http.post("/api/v1/get_info", json={"model_id": model_id}, headers=headers),
    ]


def _sdk(http: httpx.Client, tenant: TenantHandle) -> tuple[tinker.ServiceClient, tinker.RestClient]:
    url, key = str(http.base_url), "tml-" + tenant.key
    return tinker.ServiceClient(base_url=url, api_key=key), tinker.RestClient(base_url=url, api_key=key)


def test_a_deleted_models_reads_answer_the_unknown_models_404(http: httpx.Client) -> None:
    tenant = new_tenant(http, quota=3)
    service, rest = _sdk(http, tenant)
    try:
        training = service.create_lora_training_client(BASE_MODEL, rank=4, train_unembed=False).result()
        kept = service.create_lora_training_client(BASE_MODEL, rank=4, train_unembed=False).result()
        model_id = training.model_id

        # While its run lives, every read answers.
        assert rest.get_training_run(model_id).result().training_run_id == model_id
        assert rest.list_checkpoints(model_id).result().checkpoints == []
        assert training.get_info().model_id == model_id
        assert all(r.status_code == 200 for r in _reads(http, tenant, model_id))

        deleted = http.delete(f"/v1/runs/{run_of(http, tenant, model_id)}", headers=tenant.headers)
        assert deleted.status_code == 200, deleted.text

        # Through the SDK: each raises at once, as for a model never made.
        with pytest.raises(tinker.NotFoundError, match=f"model {model_id} not found"):
            rest.get_training_run(model_id).result()
        with pytest.raises(tinker.NotFoundError, match=f"model {model_id} not found"):
            rest.get_training_run_by_tinker_path(f"tinker://{model_id}/weights/any").result()
        with pytest.raises(tinker.NotFoundError, match=f"model {model_id} not found"):
            rest.list_checkpoints(model_id).result()
        # By hand: the very body an unknown model gets; get_info too (the SDK asks it once, when it
        # makes a training client, and answers `TrainingClient.get_info` from that).
        unknown = f"{service.holder.get_session_id()}:train:99"
        for gone, never in zip(_reads(http, tenant, model_id), _reads(http, tenant, unknown), strict=True):
            _not_found(gone, model_id)
            _not_found(never, unknown)

        # The listing agrees, and the other model reads as before.
        assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [
            kept.model_id
        ]
        assert all(r.status_code == 200 for r in _reads(http, tenant, kept.model_id))
    finally:
        service.close("success").result()


def test_an_evicted_model_still_reads(http: httpx.Client) -> None:
    """Only deletion hides a model: an evicted run stays the tenant's, listed and readable."""
    tenant = new_tenant(http, quota=2)
    service, rest = _sdk(http, tenant)
    try:
        training = service.create_lora_training_client(BASE_MODEL, rank=4, train_unembed=False).result()
        model_id = training.model_id
        evicted = http.post(
            f"/v1/runs/{run_of(http, tenant, model_id)}/evict",
            json={"reason": "done with it"},
            headers=tenant.headers,
        )
        assert evicted.status_code == 200 and evicted.json()["status"] == "evicted", evicted.text
        answers: list[Any] = _reads(http, tenant, model_id)
        assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
        assert rest.get_training_run(model_id).result().training_run_id == model_id
    finally:
        service.close("success").result()
