"""The unmodified `tinker` SDK with its default arguments against the real service and a real pool
(the built-in model): `train_unembed=True` trains a LoRA on `lm_head` that exports and loads in
peft, `get_tokenizer()` loads offline, and the RestClient lists, describes and deletes the
tenant's checkpoints while another tenant gets 404s."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types

from contracts.tokenizer import CharTokenizer
from tests.e2e.helpers import MODEL_CACHE, download_adapter_tensors, extract_adapter
from tests.e2e.tinker_harness import (
    BASE_MODEL,
    datums,
    running_pool,
    tenant_key,
    train_steps,
    wait_until_served,
)
from trainer_core.models.registry import load_base_model

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.timeout(300)]

EVERY_MODULE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
TEXTS = ["1+2=3", "4+4=8", "7+1=8"]


def test_sdk_defaults_train_the_unembedding_and_its_tokenizer_loads_offline(
    live_service, tmp_path, monkeypatch
):
    key, http = tenant_key(live_service, "tinker-defaults")
    # The SDK's defaults: rank 32, attention, MLP and unembedding.
    with running_pool(live_service.url, tmp_path, target_modules=EVERY_MODULE, max_rank=32), http:
        wait_until_served(live_service.url, key, timeout=30)
        service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
        try:
            training = service.create_lora_training_client(BASE_MODEL).result()
            run = http.get("/v1/runs").json()["items"][0]
            assert run["config"]["lora"]["rank"] == 32
            assert sorted(run["config"]["lora"]["target_modules"]) == sorted(EVERY_MODULE)

            # get_tokenizer() is AutoTokenizer.from_pretrained(tokenizer_id) on the user's machine;
            # tokenizer_id is the base model's name, and for the built-in model (on no hub) a
            # directory of that name in the working directory, written by `loraloom tokenizer`.
            assert training.get_info().model_data.tokenizer_id == BASE_MODEL
            workdir = tmp_path / "client"
            workdir.mkdir()
            loraloom = Path(sys.executable).with_name("loraloom")
            subprocess.run([str(loraloom), "tokenizer"], cwd=workdir, check=True, capture_output=True)
            monkeypatch.chdir(workdir)
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
            tokenizer = training.get_tokenizer()
            chars = CharTokenizer()
            for text in TEXTS:
                ids = tokenizer.encode(text, add_special_tokens=False)
                assert ids == chars.encode(text)
                assert tokenizer.decode(ids) == text
            data = []
            for text in TEXTS:
                seq = [chars.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
                    )
                )

            losses = train_steps(training, data, steps=10, lr=5e-3)
            assert losses[-1] < 0.8 * losses[0], losses

            saved = training.save_weights_for_sampler("final").result()
            resolved = httpx.get(
                f"{live_service.url}/api/v1/loraloom/resolve",
                params={"path": saved.path},
                headers={"X-API-Key": "tml-" + key},
            ).json()
            adapter_dir = extract_adapter(http, resolved["run_id"], resolved["step"], tmp_path / "adapter")
            config = json.loads((adapter_dir / "adapter_config.json").read_text())
            assert sorted(config["target_modules"]) == sorted(EVERY_MODULE)
            tensors = download_adapter_tensors(http, run["id"])
            assert tensors["base_model.model.lm_head.lora_B.weight"].abs().sum() > 0  # it trained

            # peft, given the adapter, gives the trainer's logprobs; without the lm_head delta it would not.
            now = training.forward(data, "cross_entropy").result()
            base = load_base_model(BASE_MODEL, cache_dir=MODEL_CACHE)
            peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()
            with torch.no_grad():
                for datum, out in zip(data, now.loss_fn_outputs, strict=True):
                    ids = torch.tensor([datum.model_input.to_ints()])
                    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
                    logits = peft_model(input_ids=ids).logits[0]
                    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
                    assert np.allclose(out["logprobs"].to_numpy(), expected.numpy(), atol=1e-4)
                    with peft_model.disable_adapter():
                        plain = torch.log_softmax(peft_model(input_ids=ids).logits[0], -1)
                    assert not np.allclose(
                        out["logprobs"].to_numpy(),
                        plain.gather(-1, targets[:, None])[:, 0].numpy(),
                        atol=1e-3,
                    )
        finally:
            service.close("success").result()


def test_checkpoints_list_describe_and_delete_for_their_tenant_only(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-ckpt")
    other_key, other_http = tenant_key(live_service, "tinker-ckpt-other")
    with running_pool(live_service.url, tmp_path), http, other_http:
        wait_until_served(live_service.url, key, timeout=30)
        service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
        rest = tinker.RestClient(base_url=live_service.url, api_key="tml-" + key)
        other = tinker.RestClient(base_url=live_service.url, api_key="tml-" + other_key)
        try:
            training = service.create_lora_training_client(
                BASE_MODEL, rank=4, seed=1, train_unembed=False, train_mlp=False
            ).result()
            model_id = training.model_id
            assert rest.list_checkpoints(model_id).result().checkpoints == []
            train_steps(training, datums(), steps=1)
            state = training.save_state("s1").result().path
            sampler = training.save_weights_for_sampler("w1").result().path

            listed = rest.list_checkpoints(model_id).result().checkpoints
            assert {(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed} == {
                ("weights/s1", "training", state),
                ("sampler_weights/w1", "sampler", sampler),
            }
            mine = rest.list_user_checkpoints().result()
            assert {c.tinker_path for c in mine.checkpoints} == {state, sampler}
            assert mine.cursor is not None and mine.cursor.total_count == 2
            page = rest.list_user_checkpoints(limit=1, offset=1).result()
            assert (
                len(page.checkpoints) == 1
                and page.checkpoints[0].tinker_path == mine.checkpoints[1].tinker_path
            )

            run = rest.get_training_run_by_tinker_path(state).result()
            assert run.training_run_id == model_id
            assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
            assert (
                run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler
            )
            info = rest.get_weights_info_by_tinker_path(state).result()
            assert (info.base_model, info.lora_rank, info.is_lora) == (BASE_MODEL, 4, True)
            assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, False)

            # Another tenant: every path and model of this one is not found; its own list is empty.
            for call in (
                lambda: other.list_checkpoints(model_id).result(),
                lambda: other.get_training_run_by_tinker_path(state).result(),
                lambda: other.get_weights_info_by_tinker_path(sampler).result(),
                lambda: other.delete_checkpoint_from_tinker_path(state).result(),
            ):
                with pytest.raises(tinker.NotFoundError):
                    call()
            assert other.list_user_checkpoints().result().checkpoints == []
            assert len(rest.list_checkpoints(model_id).result().checkpoints) == 2  # nothing deleted

            # Deleted: the path no longer lists, describes, loads or samples.
            rest.delete_checkpoint_from_tinker_path(state).result()
            assert [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints] == [sampler]
            with pytest.raises(tinker.NotFoundError):
                rest.get_weights_info_by_tinker_path(state).result()
            with pytest.raises(tinker.NotFoundError):
                service.create_training_client_from_state(state).result()
            with pytest.raises(tinker.NotFoundError):
                rest.delete_checkpoint_from_tinker_path(state).result()
            rest.delete_checkpoint(model_id, "sampler_weights/w1").result()
            with pytest.raises(tinker.NotFoundError):
                service.create_sampling_client(model_path=sampler).result()
            assert rest.list_user_checkpoints().result().checkpoints == []
            # Saved again under the same name, it is back.
            again = training.save_state("s1").result().path
            assert [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints] == [again]
        finally:
            service.close("success").result()


def test_a_pool_without_the_sdks_defaults_names_what_it_lacks(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-narrow-pool")
    # Attention only, rank 8: neither the SDK's default rank (32) nor its MLP / unembedding fit.
    with running_pool(live_service.url, tmp_path), http:
        wait_until_served(live_service.url, key, timeout=30)
        service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
        try:
            with pytest.raises(tinker.UnprocessableEntityError, match="lm_head") as refused:
                service.create_lora_training_client(BASE_MODEL).result()
            assert "rank" in str(refused.value)
            assert http.get("/v1/runs").json()["items"] == []  # nothing stored
        finally:
            service.close("success").result()
