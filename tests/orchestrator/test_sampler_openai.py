"""OpenAICompatibleSampler against a small local OpenAI-compatible server (uvicorn)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from contracts.http import RetryPolicy
from orchestrator.errors import NotFound
from orchestrator.samplers import OpenAICompatibleSampler
from orchestrator.samplers.openai import SamplerError
from tests.orchestrator.fake_openai import EOS, FakeOpenAIServer
from tests.orchestrator.servers import FaultInjector, serve

FAST = RetryPolicy(max_attempts=3, backoff_base_s=0.01, backoff_max_s=0.02)


@pytest.fixture
def server() -> FakeOpenAIServer:
    return FakeOpenAIServer()


@pytest.fixture
def faults(server: FakeOpenAIServer) -> FaultInjector:
    return FaultInjector(server.app)


@pytest.fixture
def url(faults: FaultInjector) -> Iterator[str]:
    with serve(faults) as base:
        yield base


async def test_generate_parses_tokens_and_logprobs_prompt_major(url: str, server: FakeOpenAIServer) -> None:
    prompts = [[1, 10, 11], [1, 20]]
    async with OpenAICompatibleSampler(url, "tiny-base", retry=FAST) as sampler:
        out = await sampler.generate(
            prompts, n=2, max_tokens=8, temperature=0.7, top_p=0.9, stop_token_ids=[EOS]
        )
        await sampler.generate([[1, 5]], n=1, max_tokens=2)
    assert len(out) == 4
    for k, completion in enumerate(out):
        i, j = divmod(k, 2)
        assert completion.token_ids == FakeOpenAIServer.tokens_for(prompts[i], j, 8)
        assert completion.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])
        assert completion.finish_reason == "stop"
    body = server.completion_requests[0]
    assert body["prompt"] == prompts and body["model"] == "tiny-base"
    assert (body["n"], body["max_tokens"], body["temperature"], body["top_p"]) == (2, 8, 0.7, 0.9)
    assert (
        body["logprobs"] == 1
        and body["return_tokens_as_token_ids"] is True
        and body["stop_token_ids"] == [EOS]
    )
    second = server.completion_requests[1]
    assert second["max_tokens"] == 2
    assert server.client_ports[0] == server.client_ports[1]  # one pooled keep-alive connection


async def test_load_adapter_switches_model_and_unloads_previous(
    url: str, server: FakeOpenAIServer, tmp_path: Path
) -> None:
    async with OpenAICompatibleSampler(url, "tiny-base", retry=FAST) as sampler:
        await sampler.load_adapter(tmp_path / "step_1", "run_x-step-1", 1)
        await sampler.generate([[1, 2]], n=1, max_tokens=4)
        await sampler.load_adapter(tmp_path / "step_2", "run_x-step-2", 2)
        await sampler.generate([[1, 2]], n=1, max_tokens=4)
        await sampler.load_adapter(tmp_path / "step_2", "run_x-step-2", 2)  # "already loaded" is fine
        assert (sampler.model, sampler.adapter_step) == ("run_x-step-2", 2)
    assert server.lora_calls[:3] == [
        ("load", {"lora_name": "run_x-step-1", "lora_path": str((tmp_path / "step_1").resolve())}),
        ("load", {"lora_name": "run_x-step-2", "lora_path": str((tmp_path / "step_2").resolve())}),
        ("unload", {"lora_name": "run_x-step-1"}),
    ]
    assert [r["model"] for r in server.completion_requests] == ["run_x-step-1", "run_x-step-2"]
    assert server.loaded == {"run_x-step-2": str((tmp_path / "step_2").resolve())}


async def test_retries_on_503_and_dropped_connections(
    url: str, server: FakeOpenAIServer, faults: FaultInjector
) -> None:
    faults.inject("POST", "/v1/completions", "503", "drop")
    async with OpenAICompatibleSampler(url, "tiny-base", retry=FAST) as sampler:
        out = await sampler.generate([[1, 2]], n=3, max_tokens=8)
    assert len(out) == 3 and len(faults.requests_to("POST", "/v1/completions")) == 3


async def test_errors_are_typed(url: str) -> None:
    async with OpenAICompatibleSampler(url, "no-such-model", retry=FAST) as sampler:
        with pytest.raises(NotFound):
            await sampler.generate([[1, 2]], n=1, max_tokens=4)


async def test_token_ids_field_and_plain_tokens() -> None:
    with_ids = FakeOpenAIServer(token_ids_field=True)
    with serve(with_ids.app) as base:
        async with OpenAICompatibleSampler(base, "tiny-base", retry=FAST) as sampler:
            out = await sampler.generate([[1, 9]], n=1, max_tokens=3)
    assert out[0].token_ids == FakeOpenAIServer.tokens_for([1, 9], 0, 3) and out[0].finish_reason == "length"

    plain = FakeOpenAIServer(plain_tokens=True)
    with serve(plain.app) as base:
        async with OpenAICompatibleSampler(base, "tiny-base", retry=FAST) as sampler:
            with pytest.raises(SamplerError, match="return_tokens_as_token_ids"):
                await sampler.generate([[1, 9]], n=1, max_tokens=3)
