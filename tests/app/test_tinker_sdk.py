"""The official `tinker` SDK (pinned, unmodified) against the service under uvicorn: it starts
cleanly, creates LoRA training models that are runs in manual mode, reads their info, lists
them, and gets a clear error for what loraloom does not serve."""

import httpx
import pytest
import tinker
from tinker import types

from tests.app.api import TenantHandle, new_tenant

BASE_MODEL = "loraloom-tiny"


def _service_client(http: httpx.Client, tenant: TenantHandle) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=str(http.base_url), api_key="tml-" + tenant.key)


def _rest_client(http: httpx.Client, tenant: TenantHandle) -> tinker.RestClient:
    return tinker.RestClient(base_url=str(http.base_url), api_key="tml-" + tenant.key)


def test_sdk_creates_a_lora_training_model_backed_by_a_manual_run(http):
    tenant = new_tenant(http, quota=2)
    service = _service_client(http, tenant)
    try:
        training = service.create_lora_training_client(
            base_model=BASE_MODEL, rank=4, seed=3, train_unembed=False, train_mlp=False
        ).result()
        model_id = training.model_id
        session_id = service.holder.get_session_id()
        assert model_id == f"{session_id}:train:0"

        info = training.get_info()
        assert (info.model_id, info.lora_rank, info.is_lora) == (model_id, 4, True)
        assert info.model_data.model_name == BASE_MODEL

        # The model is a run of the tenant in manual mode, with the requested LoRA.
        runs = http.get("/v1/runs", headers=tenant.headers).json()["items"]
        assert len(runs) == 1
        config = runs[0]["config"]
        assert config["mode"] == "manual"
        assert config["lora"]["rank"] == 4 and config["seed"] == 3
        assert config["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
        assert runs[0]["status"] == "active"

        rest = _rest_client(http, tenant)
        listed = rest.list_training_runs().result()
        assert [r.training_run_id for r in listed.training_runs] == [model_id]
        assert listed.cursor.total_count == 1
        assert rest.get_training_run(model_id).result().lora_rank == 4
    finally:
        service.close("success").result()


def test_unsupported_calls_answer_a_clear_error_through_the_sdk(http):
    tenant = new_tenant(http, quota=2)
    service = _service_client(http, tenant)
    try:
        with pytest.raises(tinker.BadRequestError, match="not supported by loraloom: train_unembed"):
            service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        training = service.create_lora_training_client(
            base_model=BASE_MODEL, rank=4, train_unembed=False
        ).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
        with pytest.raises(tinker.BadRequestError, match="not supported by loraloom: loss_fn 'dro'"):
            training.forward_backward([datum], "dro").result()
        with pytest.raises(
            tinker.BadRequestError, match="not supported by loraloom: GET /api/v1/training_runs/"
        ):
            _rest_client(http, tenant).list_checkpoints(training.model_id).result()
        # The base model samples only where a pool serves it (none here).
        with pytest.raises(tinker.NotFoundError, match="no pool serves the base model 'loraloom-tiny'"):
            service.create_sampling_client(base_model=BASE_MODEL).result()
    finally:
        service.close("success").result()


def test_keys_are_checked_and_tenants_see_only_their_own_models(http):
    acme, globex = new_tenant(http), new_tenant(http)
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=str(http.base_url), api_key="tml-llk_not-a-key")
    # A loraloom key without the SDK's prefix is refused by the service too.
    r = http.post("/api/v1/client/config", json={"sdk_version": "x"}, headers={"X-API-Key": acme.key})
    assert r.status_code == 401

    service = _service_client(http, acme)
    other = _service_client(http, globex)
    try:
        training = service.create_lora_training_client(BASE_MODEL, rank=2, train_unembed=False).result()
        with pytest.raises(tinker.NotFoundError):
            _rest_client(http, globex).get_training_run(training.model_id).result()
        assert _rest_client(http, globex).list_training_runs().result().training_runs == []
        r = http.post(
            "/api/v1/get_info",
            json={"model_id": training.model_id},
            headers={"X-API-Key": "tml-" + globex.key},
        )
        assert r.status_code == 404
    finally:
        service.close("success").result()
        other.close("success").result()
