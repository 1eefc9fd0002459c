"""The unmodified `tinker` SDK against the real service (uvicorn on Postgres) and a real pool (the
built-in model, one rank, in a thread of this process so the test can pause its claims):
forward_backward + optim_step train, the losses run, several tenants share passes, a run that
leaves fails its futures and the pool goes on."""

import httpx
import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types

from tests.e2e.helpers import MODEL_CACHE, download_adapter_tensors, extract_adapter, wait_for
from tests.e2e.tinker_harness import (
    BASE_MODEL,
    datums,
    pending_futures,
    running_pool,
    tenant_key,
    train_steps,
    wait_until_served,
)
from trainer_core.models.registry import load_base_model

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only, pytest.mark.timeout(300)]


def test_sdk_trains_on_the_pool_and_the_run_shows_in_the_api(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-train")
    with running_pool(live_service.url, tmp_path) as pool, http:
        service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
        try:
            wait_until_served(live_service.url, key, timeout=30)
            training = service.create_lora_training_client(
                BASE_MODEL, rank=4, seed=1, train_unembed=False, train_mlp=False
            ).result()
            data = datums()

            # forward: per-token logprobs of the targets, and nothing trained.
            fwd = training.forward(data, "cross_entropy").result()
            assert [len(o["logprobs"].tolist()) for o in fwd.loss_fn_outputs] == [7, 5, 6]
            lp = np.concatenate([o["logprobs"].to_numpy() for o in fwd.loss_fn_outputs])
            assert np.all(lp < 0)
            assert fwd.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5)

            losses = train_steps(training, data, steps=10)
            assert losses[0] == pytest.approx(fwd.metrics["loss:sum"], rel=1e-5)
            assert losses[-1] < 0.8 * losses[0], losses

            # importance_sampling and ppo, with the sampler's logprobs and advantages.
            for loss_fn in ("importance_sampling", "ppo", "cispo"):
                now = training.forward(data, "cross_entropy").result()
                rl = [
                    types.Datum(
                        model_input=d.model_input,
                        loss_fn_inputs={
                            "target_tokens": d.loss_fn_inputs["target_tokens"],
                            "logprobs": out["logprobs"].tolist(),
                            "advantages": [0.5] * len(out["logprobs"].tolist()),
                        },
                    )
                    for d, out in zip(data, now.loss_fn_outputs, strict=True)
                ]
                res = training.forward_backward(rl, loss_fn).result()
                if loss_fn == "cispo":  # −Σ A·lp at ratio 1
                    lp_now = np.concatenate([o["logprobs"].to_numpy() for o in now.loss_fn_outputs])
                    assert res.metrics["loss:sum"] == pytest.approx(-0.5 * lp_now.sum(), rel=1e-4)
                else:  # at ratio 1 both are −Σ A
                    assert res.metrics["loss:sum"] == pytest.approx(-0.5 * 18, rel=1e-4)
                training.optim_step(types.AdamParams(learning_rate=1e-3)).result()

            # save_weights_for_sampler names the adapter of this step; it downloads and loads in peft,
            # which gives the logprobs the trainer gives.
            saved = training.save_weights_for_sampler("final").result()
            assert saved.path == f"tinker://{training.model_id}/sampler_weights/final"
            resolved = httpx.get(
                f"{live_service.url}/api/v1/loraloom/resolve",
                params={"path": saved.path},
                headers={"X-API-Key": "tml-" + key},
            ).json()
            assert resolved["step"] == 13

            # sample from those weights: the returned logprobs are what a forward of the same tokens gives.
            sampler = service.create_sampling_client(model_path=saved.path).result()
            prompt = [1, 2, 3]
            sampled = sampler.sample(
                types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=5, seed=7)
            ).result()
            assert len(sampled.sequences) == 2
            for seq in sampled.sequences:
                # Five tokens, or fewer ending with the end of sequence: which one the trained adapter
                # samples depends on rounding that differs between CPUs (an AMD EPYC instance drew it
                # as the third token with this seed).
                n = len(seq.tokens)
                assert (n == 5 and seq.stop_reason == "length") or (1 <= n <= 5 and seq.stop_reason == "stop")
                full = prompt + list(seq.tokens)
                check = types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
                )
                scored = training.forward([check], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
                assert np.allclose(scored.tolist()[-n:], seq.logprobs, atol=1e-4)
            now = training.forward(data, "cross_entropy").result()
            adapter_dir = extract_adapter(http, resolved["run_id"], resolved["step"], tmp_path / "adapter")
            peft_model = PeftModel.from_pretrained(
                load_base_model(BASE_MODEL, cache_dir=MODEL_CACHE), adapter_dir
            )
            with torch.no_grad():
                for datum, out in zip(data, now.loss_fn_outputs, strict=True):
                    ids = torch.tensor([datum.model_input.to_ints()])
                    logits = peft_model(input_ids=ids).logits[0]
                    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
                    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
                    assert np.allclose(out["logprobs"].to_numpy(), expected.numpy(), atol=1e-4)

            run = http.get("/v1/runs").json()["items"][0]
            assert run["config"]["mode"] == "manual"
            assert run["progress"]["step"] == 13
            metrics = http.get(f"/v1/runs/{run['id']}/metrics").json()["items"]
            assert [m["step"] for m in metrics] == list(range(1, 14))
            tensors = download_adapter_tensors(http, run["id"])
            assert any("lora_B" in name and tensors[name].abs().sum() > 0 for name in tensors)
            assert pool.trainer.manual is not None and pool.trainer.manual.passes > 0
        finally:
            service.close("success").result()


def test_two_tenants_share_passes_each_as_if_alone_and_a_deleted_run_fails_only_its_own_futures(
    live_service, tmp_path
):
    key_a, http_a = tenant_key(live_service, "tinker-a")
    key_b, http_b = tenant_key(live_service, "tinker-b")
    key_c, http_c = tenant_key(live_service, "tinker-c")
    with running_pool(live_service.url, tmp_path) as pool, http_a, http_b, http_c:
        a = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key_a)
        b = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key_b)
        c = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key_c)
        try:
            ta = a.create_lora_training_client(
                BASE_MODEL, rank=4, seed=1, train_unembed=False, train_mlp=False
            ).result()
            tb = b.create_lora_training_client(
                BASE_MODEL, rank=2, seed=2, train_unembed=False, train_mlp=False
            ).result()

            # Pause the pool's claims, submit both tenants' work, let it go: one claim takes both.
            pool.client.open.clear()
            fa = ta.forward_backward(datums(), "cross_entropy")
            fb = tb.forward_backward(datums(offset=3), "cross_entropy")
            wait_for(lambda: pending_futures(live_service) >= 2, timeout=30, what="both requests stored")
            manual = pool.trainer.manual
            assert manual is not None
            before = manual.mixed_passes
            pool.client.open.set()
            fa.result(), fb.result()
            assert manual.mixed_passes > before
            ta.optim_step(types.AdamParams(learning_rate=2e-2)).result()
            tb.optim_step(types.AdamParams(learning_rate=2e-2)).result()

            # Tenant C makes A's calls alone: its adapter is A's.
            tc = c.create_lora_training_client(
                BASE_MODEL, rank=4, seed=1, train_unembed=False, train_mlp=False
            ).result()
            mixed = manual.mixed_passes
            train_steps(tc, datums(), steps=1)
            assert manual.mixed_passes == mixed
            run_a = http_a.get("/v1/runs").json()["items"][0]["id"]
            run_c = http_c.get("/v1/runs").json()["items"][0]["id"]
            shared, alone = download_adapter_tensors(http_a, run_a), download_adapter_tensors(http_c, run_c)
            assert shared.keys() == alone.keys()
            for name in shared:
                assert torch.allclose(shared[name], alone[name], atol=1e-5), name

            # Neither tenant sees the other's models or weights.
            with pytest.raises(tinker.NotFoundError):
                tinker.RestClient(base_url=live_service.url, api_key="tml-" + key_b).get_training_run(
                    ta.model_id
                ).result()
            saved = ta.save_weights_for_sampler("mine").result()
            assert (
                httpx.get(
                    f"{live_service.url}/api/v1/loraloom/resolve",
                    params={"path": saved.path},
                    headers={"X-API-Key": "tml-" + key_b},
                ).status_code
                == 404
            )

            # Tenant B's run is deleted while its next request waits: that future fails with the
            # reason; tenant A's goes on.
            pool.client.open.clear()
            pending_b = tb.forward_backward(datums(offset=3), "cross_entropy")
            wait_for(lambda: pending_futures(live_service) >= 1, timeout=30, what="B's request stored")
            run_b = http_b.get("/v1/runs").json()["items"][0]["id"]
            assert http_b.delete(f"/v1/runs/{run_b}").status_code in (200, 204)
            pool.client.open.set()
            with pytest.raises(tinker.RequestFailedError, match="left"):
                pending_b.result()
            assert train_steps(ta, datums(), steps=2)[-1] > 0
        finally:
            for client in (a, b, c):
                client.close("success").result()


def test_save_state_then_load_with_optimizer_continues_like_the_original(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-state")
    with running_pool(live_service.url, tmp_path), http:
        service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
        try:
            original = service.create_lora_training_client(
                BASE_MODEL, rank=4, seed=5, train_unembed=False, train_mlp=False
            ).result()
            data = datums()
            train_steps(original, data, steps=3)
            saved = original.save_state("after-3").result()
            assert saved.path == f"tinker://{original.model_id}/weights/after-3"
            at_save = original.forward(data, "cross_entropy").result()

            resumed = service.create_training_client_from_state_with_optimizer(saved.path).result()
            weights_only = service.create_training_client_from_state(saved.path).result()
            # The weights are the saved ones.
            for client in (resumed, weights_only):
                out = client.forward(data, "cross_entropy").result()
                for got, want in zip(out.loss_fn_outputs, at_save.loss_fn_outputs, strict=True):
                    assert np.allclose(got["logprobs"].to_numpy(), want["logprobs"].to_numpy(), atol=1e-5)

            # With the optimizer state, training goes on exactly as the original's.
            assert np.allclose(
                train_steps(resumed, data, steps=2), train_steps(original, data, steps=2), rtol=1e-5
            )
            a = original.forward(data, "cross_entropy").result()
            b = resumed.forward(data, "cross_entropy").result()
            for got, want in zip(b.loss_fn_outputs, a.loss_fn_outputs, strict=True):
                assert np.allclose(got["logprobs"].to_numpy(), want["logprobs"].to_numpy(), atol=1e-5)

            runs = http.get("/v1/runs").json()["items"]
            assert len(runs) == 3 and all(r["config"]["mode"] == "manual" for r in runs)
        finally:
            service.close("success").result()
