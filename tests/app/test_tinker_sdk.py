"""The official `tinker` SDK (pinned, unmodified) against the service under uvicorn: it starts
cleanly, creates LoRA training models that are runs in manual mode, reads their info, lists
them, and gets a clear error for what loraloom does not serve."""

import httpx
import pytest
import tinker
from tinker import types

from contracts.tokenizer import CharTokenizer
from contracts.tokenizer_files import save_char_tokenizer
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
        training = service.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
        with pytest.raises(tinker.BadRequestError, match="not supported by loraloom: loss_fn 'dro'"):
            training.forward_backward([datum], "dro").result()
        with pytest.raises(
            tinker.BadRequestError, match="not supported by loraloom: POST /api/v1/training_runs/.*/publish"
        ):
            _rest_client(http, tenant).publish_checkpoint_from_tinker_path(
                f"tinker://{training.model_id}/sampler_weights/final"
            ).result()
        with pytest.raises(tinker.BadRequestError, match="not supported by loraloom: unpublishing"):
            _rest_client(http, tenant).unpublish_checkpoint_from_tinker_path(
                f"tinker://{training.model_id}/sampler_weights/final"
            ).result()
        with pytest.raises(
            tinker.BadRequestError, match="not supported by loraloom: PUT /api/v1/training_runs/"
        ):
            _rest_client(http, tenant).set_checkpoint_ttl_from_tinker_path(
                f"tinker://{training.model_id}/weights/final", 60
            ).result()
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


def test_sdk_defaults_create_a_model_with_the_unembedding_and_a_tokenizer_that_loads_offline(
    http, monkeypatch, tmp_path, settings
):
    tenant = new_tenant(http, quota=2)
    service = _service_client(http, tenant)
    try:
        # Unmodified user code: rank 32, train_attn, train_mlp and train_unembed all true.
        training = service.create_lora_training_client(BASE_MODEL).result()
        config = http.get("/v1/runs", headers=tenant.headers).json()["items"][0]["config"]
        assert config["lora"]["rank"] == 32
        assert config["lora"]["target_modules"] == [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"
        ]  # fmt: skip

        # get_info names the tokenizer by the base model's name, as the user gave it: no path of the
        # service's machine (it showed its data directory), and the service writes no file for it.
        info = http.post(
            "/api/v1/get_info",
            json={"model_id": training.model_id},
            headers={"X-API-Key": "tml-" + tenant.key},
        )
        assert info.status_code == 200, info.text
        assert info.json()["model_data"] == {
            "arch": None,
            "model_name": BASE_MODEL,
            "tokenizer_id": BASE_MODEL,
        }
        assert str(settings.data_dir) not in info.text
        assert training.get_info().model_data.tokenizer_id == BASE_MODEL
        assert not (settings.data_dir / "tokenizers").exists()

        # get_tokenizer() is AutoTokenizer.from_pretrained(tokenizer_id) on the user's machine; the
        # built-in model is on no hub, so its character tokenizer is a directory of that name in the
        # working directory, written by the user's side (here the test's), loaded without the network.
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.chdir(tmp_path)
        save_char_tokenizer(tmp_path / BASE_MODEL)
        tokenizer = training.get_tokenizer()
        chars = CharTokenizer()
        text = "12+34=46 ok?\nHello, World!"
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == chars.encode(text)
        assert tokenizer.decode(ids) == text
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
            chars.bos_token_id,
            chars.eos_token_id,
            chars.pad_token_id,
        )
        assert (
            tokenizer.decode([chars.bos_token_id, *ids, chars.eos_token_id], skip_special_tokens=True) == text
        )

        # The SDK checks this itself; a raw request gets the service's own 422, and no model.
        body = {
            "session_id": service.holder.get_session_id(),
            "model_seq_id": 7,
            "base_model": BASE_MODEL,
            "lora_config": {"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False},
        }
        r = http.post("/api/v1/create_model", json=body, headers={"X-API-Key": "tml-" + tenant.key})
        assert r.status_code == 422
        assert "at least one of train_attn, train_mlp or train_unembed" in r.json()["error"]["message"]
        assert len(http.get("/v1/runs", headers=tenant.headers).json()["items"]) == 1
    finally:
        service.close("success").result()


def test_checkpoint_calls_are_scoped_to_the_tenant_and_check_their_paths(http):
    acme, globex = new_tenant(http), new_tenant(http)
    service = _service_client(http, acme)
    try:
        training = service.create_lora_training_client(BASE_MODEL, rank=2, train_unembed=False).result()
        rest, other = _rest_client(http, acme), _rest_client(http, globex)
        assert rest.list_checkpoints(training.model_id).result().checkpoints == []
        listed = rest.list_user_checkpoints().result()
        assert listed.checkpoints == [] and listed.cursor is not None and listed.cursor.total_count == 0
        never_saved = f"tinker://{training.model_id}/weights/nothing"
        with pytest.raises(tinker.NotFoundError):
            rest.get_weights_info_by_tinker_path(never_saved).result()
        with pytest.raises(tinker.NotFoundError):
            rest.delete_checkpoint_from_tinker_path(never_saved).result()
        with pytest.raises(tinker.NotFoundError):
            other.list_checkpoints(training.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            other.get_training_run_by_tinker_path(never_saved).result()
        # Not a checkpoint path: 400 with the shape it should have.
        r = http.post(
            "/api/v1/weights_info",
            json={"tinker_path": f"tinker://{training.model_id}/elsewhere/x"},
            headers={"X-API-Key": "tml-" + acme.key},
        )
        assert r.status_code in (400, 422) and "not a checkpoint path" in r.json()["error"]["message"]
        r = http.delete(
            f"/api/v1/training_runs/{training.model_id}/checkpoints/weights",
            headers={"X-API-Key": "tml-" + acme.key},
        )
        assert r.status_code in (400, 422), r.text
    finally:
        service.close("success").result()
