"""Sampling through the unmodified `tinker` SDK on a real pool (built-in model): sampling clients of an
older step and of the base model, seeds, greedy decoding, stop tokens and stop strings, prompt
logprobs, and two tenants' requests decoded in one generation pass; every sampled token's logprob
is what a forward of the same weights gives."""

from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from tinker import types

from contracts.tokenizer import CharTokenizer
from tests.e2e.helpers import MODEL_CACHE, extract_adapter, wait_for
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

PROMPT = [1, 20, 21, 22]


@torch.no_grad()
def _logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> np.ndarray:
    """The logprob of each generated token from one forward of prompt + generated."""
    full = prompt + generated
    logits = model(input_ids=torch.tensor([full])).logits[0, len(prompt) - 1 : -1]  # (n, V)
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(generated)[:, None])[:, 0].numpy()


def _sample(client, n: int = 1, **params) -> types.SampleResponse:
    return client.sample(types.ModelInput.from_ints(PROMPT), n, types.SamplingParams(**params)).result()


def test_sampling_older_weights_the_base_model_seeds_and_stops_through_the_sdk(live_service, tmp_path):
    key, http = tenant_key(live_service, "tinker-sample")
    with running_pool(live_service.url, tmp_path) as pool, http:
        service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
        try:
            wait_until_served(live_service.url, key, timeout=30)
            training = service.create_lora_training_client(
                BASE_MODEL, rank=4, seed=1, train_unembed=False, train_mlp=False
            ).result()
            data = datums()
            train_steps(training, data, steps=3, lr=5e-2)
            older_path = training.save_weights_for_sampler("step3").result().path
            older = service.create_sampling_client(model_path=older_path).result()
            train_steps(training, data, steps=3, lr=5e-2)
            newer = service.create_sampling_client(
                model_path=training.save_weights_for_sampler("step6").result().path
            ).result()

            # The older client samples step 3's adapter although the run is at step 6: its logprobs
            # are a forward of step 3's published adapter (peft), not of step 6's.
            resolved = httpx.get(
                f"{live_service.url}/api/v1/loraloom/resolve",
                params={"path": older_path},
                headers={"X-API-Key": "tml-" + key},
            ).json()
            assert resolved["step"] == 3
            base = load_base_model(BASE_MODEL, cache_dir=MODEL_CACHE).eval()
            step3 = PeftModel.from_pretrained(
                load_base_model(BASE_MODEL, cache_dir=MODEL_CACHE),
                extract_adapter(http, resolved["run_id"], 3, tmp_path / "step3"),
            ).eval()
            step6 = PeftModel.from_pretrained(
                load_base_model(BASE_MODEL, cache_dir=MODEL_CACHE),
                extract_adapter(http, resolved["run_id"], 6, tmp_path / "step6"),
            ).eval()
            old = _sample(older, 2, max_tokens=6, seed=5, stop=[])
            for seq in old.sequences:
                assert len(seq.tokens) == 6 and seq.stop_reason == "length"
                assert np.allclose(seq.logprobs, _logprobs(step3, PROMPT, list(seq.tokens)), atol=1e-4)
                assert not np.allclose(seq.logprobs, _logprobs(step6, PROMPT, list(seq.tokens)), atol=1e-3)
            new = _sample(newer, max_tokens=6, seed=5, stop=[]).sequences[0]
            assert np.allclose(new.logprobs, _logprobs(step6, PROMPT, list(new.tokens)), atol=1e-4)

            # The base model, no adapter: its logprobs are the base model's.
            plain = service.create_sampling_client(base_model=BASE_MODEL).result()
            for seq in _sample(plain, 2, max_tokens=6, seed=9, stop=[]).sequences:
                assert np.allclose(seq.logprobs, _logprobs(base, PROMPT, list(seq.tokens)), atol=1e-4)

            # Seeds: the same request twice gives the same tokens; temperature 0 is greedy.
            again = [list(s.tokens) for s in _sample(newer, 3, max_tokens=8, seed=42, stop=[]).sequences]
            assert again == [
                list(s.tokens) for s in _sample(newer, 3, max_tokens=8, seed=42, stop=[]).sequences
            ]
            assert len({tuple(t) for t in again}) > 1  # each sequence of a request draws its own
            greedy = list(_sample(newer, max_tokens=8, temperature=0.0, stop=[]).sequences[0].tokens)
            with torch.no_grad():
                tokens = list(PROMPT)
                for _ in range(8):
                    tokens.append(int(step6(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
            assert greedy == tokens[len(PROMPT) :]
            assert (
                list(_sample(newer, max_tokens=8, temperature=0.0, seed=1, stop=[]).sequences[0].tokens)
                == greedy
            )

            # Stop tokens and strings: the sequence ends at the first match, that token included.
            at = greedy[3]
            by_token = _sample(newer, max_tokens=8, temperature=0.0, stop=[at]).sequences[0]
            assert list(by_token.tokens) == greedy[: greedy.index(at) + 1] and by_token.stop_reason == "stop"
            text = CharTokenizer().decode(greedy)
            stop_text = text[2:4]
            by_string = _sample(newer, max_tokens=8, temperature=0.0, stop=[stop_text]).sequences[0]
            assert by_string.stop_reason == "stop"
            assert stop_text in CharTokenizer().decode(list(by_string.tokens))
            assert stop_text not in CharTokenizer().decode(list(by_string.tokens)[:-1])
            assert list(by_string.tokens) == greedy[: len(by_string.tokens)]
            assert _sample(newer, max_tokens=3, temperature=0.0, stop=[]).sequences[0].stop_reason == "length"

            # Prompt logprobs: a forward of the prompt (None for the first token); the last N only.
            with torch.no_grad():
                logits = step6(input_ids=torch.tensor([PROMPT])).logits[0, :-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(PROMPT[1:])[:, None])[
                :, 0
            ]
            scored = newer.sample(
                types.ModelInput.from_ints(PROMPT),
                1,
                types.SamplingParams(max_tokens=2),
                include_prompt_logprobs=True,
            ).result()
            assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
            assert np.allclose(scored.prompt_logprobs[1:], expected.numpy(), atol=1e-4)
            computed = newer.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()  # the SDK's helper
            assert computed[0] is None and np.allclose(computed[1:], expected.numpy(), atol=1e-4)
            last = newer.sample(
                types.ModelInput.from_ints(PROMPT),
                1,
                types.SamplingParams(max_tokens=2),
                include_prompt_logprobs=True,
                prompt_logprobs_last_n=2,
            ).result()
            assert last.prompt_logprobs is not None and last.prompt_logprobs[:2] == [None, None]
            assert np.allclose(last.prompt_logprobs[2:], expected.numpy()[-2:], atol=1e-4)
            with pytest.raises(
                tinker.BadRequestError, match="not supported by loraloom: sample option topk_prompt_logprobs"
            ):
                newer.sample(
                    types.ModelInput.from_ints(PROMPT),
                    1,
                    types.SamplingParams(max_tokens=2),
                    include_prompt_logprobs=True,
                    topk_prompt_logprobs=2,
                ).result()
            assert pool.trainer.manual is not None and pool.trainer.manual.samples.passes > 0
        finally:
            service.close("success").result()


def test_the_base_model_samples_on_a_pool_that_holds_no_tinker_model(live_service, tmp_path):
    """A base-model sampling client needs no run: the pool asks for its requests although it has no
    Tinker model (and so no other reason to ask for manual work)."""
    key, http = tenant_key(live_service, "tinker-base")
    with running_pool(live_service.url, tmp_path) as pool, http:
        service = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key)
        try:
            wait_until_served(live_service.url, key, timeout=30)
            plain = service.create_sampling_client(base_model=BASE_MODEL).result()
            sampled = _sample(plain, 2, max_tokens=5, seed=3, stop=[])
            assert not pool.trainer.slots
            base = load_base_model(BASE_MODEL, cache_dir=MODEL_CACHE).eval()
            for seq in sampled.sequences:
                assert len(seq.tokens) == 5 and seq.stop_reason == "length"
                assert np.allclose(seq.logprobs, _logprobs(base, PROMPT, list(seq.tokens)), atol=1e-4)
        finally:
            service.close("success").result()


def _forward_logprobs(training, prompt: list[int], generated: list[int]) -> np.ndarray:
    """The trainer's logprobs of `generated` after `prompt` (a Tinker `forward`)."""
    full = prompt + generated
    # The SDK converts plain lists to TensorData.
    inputs: dict[str, Any] = {"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)}
    datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs=inputs)
    out = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return np.asarray(out.tolist()[-len(generated) :])


def test_two_tenants_samples_decode_in_one_generation_pass_each_with_its_own_adapter(live_service, tmp_path):
    key_a, http_a = tenant_key(live_service, "tinker-sample-a")
    key_b, http_b = tenant_key(live_service, "tinker-sample-b")
    with running_pool(live_service.url, tmp_path) as pool, http_a, http_b:
        a = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key_a)
        b = tinker.ServiceClient(base_url=live_service.url, api_key="tml-" + key_b)
        try:
            ta = a.create_lora_training_client(
                BASE_MODEL, rank=4, seed=1, train_unembed=False, train_mlp=False
            ).result()
            tb = b.create_lora_training_client(
                BASE_MODEL, rank=2, seed=2, train_unembed=False, train_mlp=False
            ).result()
            train_steps(ta, datums(), steps=2, lr=5e-2)
            train_steps(tb, datums(offset=3), steps=2, lr=5e-2)
            sa = a.create_sampling_client(model_path=ta.save_weights_for_sampler("a").result().path).result()
            sb = b.create_sampling_client(model_path=tb.save_weights_for_sampler("b").result().path).result()
            manual = pool.trainer.manual
            assert manual is not None

            # Pause the pool's claims, submit both tenants' samples, let them go: one claim, one pass.
            pool.client.open.clear()
            params = types.SamplingParams(max_tokens=6, seed=2, stop=[])
            fa = sa.sample(types.ModelInput.from_ints(PROMPT), 2, params)
            fb = sb.sample(types.ModelInput.from_ints(PROMPT[:2]), 1, params)
            wait_for(
                lambda: pending_futures(live_service) >= 2, timeout=30, what="both sample requests stored"
            )
            before = manual.samples.passes
            pool.client.open.set()
            ra, rb = fa.result(), fb.result()
            assert manual.samples.passes == before + 1

            # Each row went through its own tenant's adapter: its logprobs are its trainer's forward.
            for seq in ra.sequences:
                assert np.allclose(seq.logprobs, _forward_logprobs(ta, PROMPT, list(seq.tokens)), atol=1e-4)
                assert not np.allclose(
                    seq.logprobs, _forward_logprobs(tb, PROMPT, list(seq.tokens)), atol=1e-3
                )
            (seq,) = rb.sequences
            assert np.allclose(seq.logprobs, _forward_logprobs(tb, PROMPT[:2], list(seq.tokens)), atol=1e-4)
        finally:
            for client in (a, b):
                client.close("success").result()
