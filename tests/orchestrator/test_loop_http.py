"""The rollout loop with the real AsyncLoraloomClient over HTTP (against FakeService,
until the lead's test against the real service lands)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orchestrator.client import AsyncLoraloomClient
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine
from orchestrator.errors import RunEvicted
from orchestrator.loop import LoopConfig, RolloutLoop
from tests.orchestrator.fake_service import FakeService
from tests.orchestrator.fakes import TOKENIZER, ScriptedSampler, solve
from tests.orchestrator.servers import FAST, FaultInjector


def engine_for(run_id: str, sampler: ScriptedSampler, **config: Any) -> MultiAgentEngine:
    return MultiAgentEngine(
        EngineConfig(problems_per_step=2, samples_per_problem=2, **config),
        {"solver": AgentPolicy(run_id=run_id, sampler=sampler, tokenizer=TOKENIZER)},
    )


async def test_loop_over_http(
    base_url: str, service: FakeService, faults: FaultInjector, tmp_path: Path
) -> None:
    sampler = ScriptedSampler(lambda p, j: solve(p) if j % 2 == 0 else "9")
    async with AsyncLoraloomClient(base_url, service.api_key, retry=FAST) as client:
        run = await client.create_run("loop", {"batch_size": 4, "max_async_level": 100})
        service.add_adapter(run.id, 1, {"adapter_config.json": b"{}", "adapter_model.safetensors": b"w"})
        faults.inject("POST", f"/v1/runs/{run.id}/batches", "drop_after", "503")  # retried, stored once
        loop = RolloutLoop(
            client,
            engine_for(run.id, sampler),
            LoopConfig(
                max_iterations=2, adapter_dir=tmp_path, poll_interval_s=0.01, heartbeat_interval_s=None
            ),
        )
        await loop.run()
    assert [(b["rollout_step"], b["num_samples"]) for b in service.batches[run.id]] == [(1, 4), (1, 4)]
    assert service.heartbeats[run.id] >= 2
    assert sampler.adapters == [(str(tmp_path / run.id / "step_1"), f"{run.id}-step-1", 1)]
    assert (tmp_path / run.id / "step_1" / "adapter_model.safetensors").read_bytes() == b"w"


async def test_self_eviction_over_http(base_url: str, service: FakeService, tmp_path: Path) -> None:
    async with AsyncLoraloomClient(base_url, service.api_key, retry=FAST) as client:
        run = await client.create_run("no-signal", {"batch_size": 4})
        loop = RolloutLoop(
            client,
            engine_for(run.id, ScriptedSampler(lambda p, j: solve(p)), filter_mode="dapo"),
            LoopConfig(adapter_dir=tmp_path, poll_interval_s=0.01, heartbeat_interval_s=None),
        )
        with pytest.raises(RunEvicted) as info:
            await loop.run()
        stored = await client.get_run(run.id)
    assert info.value.evicted_by == "orchestrator" and "no learning signal" in (info.value.reason or "")
    assert (stored.status, stored.evicted_by, stored.eviction_reason) == (
        "evicted",
        "orchestrator",
        info.value.reason,
    )
    assert service.batches[run.id] == []
