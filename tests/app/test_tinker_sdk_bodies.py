"""What the official `tinker` SDK sends is still taken, now that the Tinker bodies are strict (ids,
names and flags of their type, JSON numbers only, loss_fn_config keys the loss reads, clip bounds
around 1): every call a training loop makes, through the SDK against uvicorn, on both databases.
A thread answers the pool's side (tests/app/tinker_calls.py): the service's intake is under test;
tests/e2e/test_tinker_pool.py and test_tinker_surface.py run the same calls on a real pool."""

import warnings
from typing import Any

import httpx
import tinker
from sqlalchemy.orm import Session
from tinker import types

from tests.app.api import new_tenant, register
from tests.app.tinker_calls import BASE_MODEL, AnsweringPool, stored

WAIT_S = 60
"""Each call's bound: a request the service refused, or one never answered, fails the test (the SDK
would retry or poll for ever)."""


def _datum(**inputs: list[float]) -> types.Datum:
    # The SDK converts plain lists to TensorData.
    loss_fn_inputs: dict[str, Any] = {"target_tokens": [2, 3, 4], **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=loss_fn_inputs)


def test_a_training_loop_through_the_sdk_passes_every_check(http: httpx.Client, db: Session) -> None:
    tenant = new_tenant(http, quota=3)
    pool_id = register(http, slots=3)  # three models train at once: each needs a slot to be served
    service = tinker.ServiceClient(base_url=str(http.base_url), api_key="tml-" + tenant.key)
    rl = {"logprobs": [-1.0, -1.0, -1.0], "advantages": [1.0, -0.5, 0.25]}
    try:
        with AnsweringPool(str(http.base_url), pool_id), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # load_state*: deprecated by the SDK, still served
            training = service.create_lora_training_client(
                BASE_MODEL, rank=4, train_unembed=False, train_mlp=False
            ).result(timeout=WAIT_S)
            training.forward_backward([_datum(weights=[1.0, 1.0, 0.0])], "cross_entropy").result(
                timeout=WAIT_S
            )
            training.forward([_datum()], "cross_entropy").result(timeout=WAIT_S)
            training.forward_backward([_datum(**rl)], "importance_sampling").result(timeout=WAIT_S)
            configs: tuple[tuple[types.LossFnType, dict[str, float] | None], ...] = (
                ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
                ("cispo", {"clip_low_threshold": 0, "clip_high_threshold": 5}),  # ints: floats on the wire
                ("ppo", None),
            )
            for loss_fn, config in configs:
                training.forward_backward([_datum(**rl)], loss_fn, loss_fn_config=config).result(
                    timeout=WAIT_S
                )
            # The SDK's defaults, and ints where floats are typed.
            training.optim_step(types.AdamParams()).result(timeout=WAIT_S)
            metrics = training.optim_step(
                types.AdamParams(learning_rate=1, weight_decay=0, grad_clip_norm=1)
            ).result(timeout=WAIT_S)
            assert (metrics.metrics or {})["lr"] == 1.0
            state = training.save_state("st").result(timeout=WAIT_S).path
            sampler_path = training.save_weights_for_sampler("s").result(timeout=WAIT_S).path
            training.load_state(state).result(timeout=WAIT_S)
            training.load_state_with_optimizer(state).result(timeout=WAIT_S)
            restored = service.create_training_client_from_state_with_optimizer(state).result(timeout=WAIT_S)
            assert restored.model_id != training.model_id
            service.create_training_client_from_state(state, user_metadata={"from": "st"}).result(
                timeout=WAIT_S
            )

            sampling = service.create_sampling_client(model_path=sampler_path)
            params = types.SamplingParams(
                max_tokens=3, temperature=0.7, top_k=5, top_p=0.9, seed=3, stop=["x"]
            )
            out = sampling.sample(
                prompt=types.ModelInput.from_ints([5, 6, 7]),
                num_samples=2,
                sampling_params=params,
                include_prompt_logprobs=True,
                prompt_logprobs_last_n=2,
            ).result(timeout=WAIT_S)
            assert len(out.sequences) == 2 and out.prompt_logprobs == [None, -1.0, -1.0]
            assert sampling.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result(
                timeout=WAIT_S
            ) == [
                None,
                -1.0,
                -1.0,
            ]
            base = service.create_sampling_client(base_model=BASE_MODEL)
            stops: tuple[str | list[int] | None, ...] = (None, [], [3, 4], "ab")
            for stop in stops:
                sampled = base.sample(
                    types.ModelInput.from_ints([5]), 1, types.SamplingParams(max_tokens=2, stop=stop)
                ).result(timeout=WAIT_S)
                assert len(sampled.sequences) == 1
    finally:
        service.close("success").result(timeout=WAIT_S)
    counts = stored(db)
    assert (
        counts["forward_backward"] == 5 and counts["optim_step"] == 2 and counts["sample"] == 2 + len(stops)
    )
    assert counts["load_weights"] == 4 and counts["models"] == 3
