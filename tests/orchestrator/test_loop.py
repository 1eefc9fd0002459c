"""The rollout loop against FakeLoopClient (a fake of the client methods the loop uses;
the client itself is tested over real HTTP in test_client.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from contracts.wire import TrainingBatch
from orchestrator.engine import AgentPolicy, EngineConfig, MultiAgentEngine, Specialization
from orchestrator.errors import RunEvicted, RunFailed
from orchestrator.loop import LoopConfig, RolloutLoop, StepReport
from orchestrator.models import BatchInfo
from tests.orchestrator.fakes import TOKENIZER, FakeLoopClient, FakeRun, ScriptedSampler, solve


def varied(prompt: str, j: int) -> str:
    return solve(prompt) if j % 2 == 0 else "x"


def uniform(prompt: str, j: int) -> str:
    return solve(prompt)


def make_engine(run_id: str, sampler: ScriptedSampler, **config: Any) -> MultiAgentEngine:
    config.setdefault("problems_per_step", 2)
    config.setdefault("samples_per_problem", 2)
    return MultiAgentEngine(
        EngineConfig(**config), {"solver": AgentPolicy(run_id=run_id, sampler=sampler, tokenizer=TOKENIZER)}
    )


def loop_config(tmp_path: Path, **kw: Any) -> LoopConfig:
    kw.setdefault("poll_interval_s", 0.001)
    kw.setdefault("heartbeat_interval_s", None)
    return LoopConfig(adapter_dir=tmp_path / "adapters", **kw)


async def test_self_evicts_after_three_empty_batches(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_async_level=100)
    engine = make_engine(run_id, ScriptedSampler(uniform), filter_mode="dapo")
    loop = RolloutLoop(client, engine, loop_config(tmp_path, max_iterations=10))
    with pytest.raises(RunEvicted) as info:
        await loop.run()
    reason = "no learning signal: every sample was filtered out in 3 consecutive batches"
    assert (info.value.run_id, info.value.reason, info.value.evicted_by) == (run_id, reason, "orchestrator")
    assert client.evictions == [(run_id, reason, "orchestrator")]
    assert client.runs[run_id].batches == [] and "submit_batch" not in client.calls
    assert len(loop.history) == 2  # the third iteration raised


async def test_empty_streak_resets_on_a_batch_with_signal(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_async_level=100)
    schedule = iter([uniform, uniform, varied, uniform, uniform, varied])
    current = [next(schedule)]
    sampler = ScriptedSampler(lambda p, j: current[0](p, j))
    engine = make_engine(run_id, sampler, filter_mode="dapo")

    def advance(report: StepReport) -> None:
        current[0] = next(schedule)

    loop = RolloutLoop(client, engine, loop_config(tmp_path, max_iterations=5), on_step=[advance])
    history = await loop.run()
    assert client.evictions == []
    assert [r.batches[run_id].submitted for r in history] == [False, False, True, False, False]
    assert len(client.runs[run_id].batches) == 1


async def test_eviction_by_the_trainer_surfaces_with_its_reason(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_async_level=100)
    gets = [0]

    def evict_on_third_look(fake: FakeRun) -> None:
        gets[0] += 1
        if gets[0] == 3:
            client.update(fake.run.id, status="evicted", eviction_reason="NaN in loss", evicted_by="trainer")

    client.on_get_run = evict_on_third_look
    loop = RolloutLoop(
        client, make_engine(run_id, ScriptedSampler(varied)), loop_config(tmp_path, max_iterations=10)
    )
    with pytest.raises(RunEvicted) as info:
        await loop.run()
    assert (info.value.reason, info.value.evicted_by, info.value.run_id) == ("NaN in loss", "trainer", run_id)
    assert len(client.runs[run_id].batches) == 1  # one iteration went through before the eviction


async def test_eviction_seen_at_submit(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_async_level=100)

    def evict_while_generating(prompt: str, j: int) -> str:
        client.update(run_id, status="evicted", eviction_reason="user stopped it", evicted_by="user")
        return varied(prompt, j)

    loop = RolloutLoop(
        client, make_engine(run_id, ScriptedSampler(evict_while_generating)), loop_config(tmp_path)
    )
    with pytest.raises(RunEvicted) as info:
        await loop.run()
    assert (info.value.reason, info.value.run_id) == ("user stopped it", run_id)


async def test_failed_run_raises_run_failed(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(status="failed")
    loop = RolloutLoop(client, make_engine(run_id, ScriptedSampler(varied)), loop_config(tmp_path))
    with pytest.raises(RunFailed):
        await loop.run()


async def test_a_run_deleted_before_its_batches_are_counted_raises_run_failed(tmp_path: Path) -> None:
    """Read active, then deleted before the loop counts what it submitted: the batches' 404 (the
    service's answer for a deleted run's batches) is the RunFailed of a run read as deleted."""

    class DeletedMeanwhile(FakeLoopClient):
        async def list_batches(self, run_id: str, **kw: Any) -> Any:
            self.update(run_id, status="deleted")
            return await super().list_batches(run_id, **kw)

    client = DeletedMeanwhile()
    run_id = client.add_run()
    loop = RolloutLoop(client, make_engine(run_id, ScriptedSampler(varied)), loop_config(tmp_path))
    with pytest.raises(RunFailed) as info:
        await loop.run()
    assert (info.value.run_id, info.value.run_status) == (run_id, "deleted")
    assert client.calls[:2] == ["get_run", "list_batches"]


async def test_respects_max_async_level(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_async_level=1)
    looks = [0]
    seen: list[tuple[int, int]] = []  # (batches already submitted, trained step) at each submit

    def slow_trainer(fake: FakeRun) -> None:
        # The trainer finishes one step every third look, never past what was submitted,
        # and uploads that step's adapter one look later.
        looks[0] += 1
        step = fake.run.progress.step
        if looks[0] % 3 == 1 and step > 0:
            fake.adapters.setdefault(step, {"adapter_config.json": b"{}"})
        if looks[0] % 3 == 0 and step < len(fake.batches):
            client.update(fake.run.id, progress=dataclasses.replace(fake.run.progress, step=step + 1))

    client.on_get_run = slow_trainer
    original_submit = client.submit_batch

    async def recording_submit(rid: str, batch: TrainingBatch, *, fmt: str = "msgpack") -> BatchInfo:
        seen.append((len(client.runs[rid].batches), client.runs[rid].run.progress.step))
        return await original_submit(rid, batch, fmt=fmt)

    monkeypatch.setattr(client, "submit_batch", recording_submit)
    loop = RolloutLoop(
        client, make_engine(run_id, ScriptedSampler(varied)), loop_config(tmp_path, max_iterations=6)
    )
    await loop.run()
    # Each batch holds batch_size samples, so batch k belongs to trainer step k.
    assert len(seen) == 6
    assert all(k - trained <= 1 for k, trained in seen)
    assert any(k - trained == 1 for k, trained in seen)  # it did run ahead, as far as allowed
    assert looks[0] > 7  # and it had to wait (poll) for the trainer
    # Every batch was sampled with an adapter the service accepts (at most 1 step behind).
    assert all(
        trained - b.step <= 1 for b, (_, trained) in zip(client.runs[run_id].batches, seen, strict=True)
    )


async def test_waits_for_a_fresh_enough_adapter(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_async_level=0)
    client.update(run_id, progress=dataclasses.replace(client.runs[run_id].run.progress, step=2))
    client.runs[run_id].adapters[1] = {"adapter_config.json": b"{}"}
    looks = [0]

    def upload_later(fake: FakeRun) -> None:
        looks[0] += 1
        if looks[0] == 5:
            fake.adapters[2] = {"adapter_config.json": b"{}"}

    client.on_get_run = upload_later
    sampler = ScriptedSampler(varied)
    loop = RolloutLoop(client, make_engine(run_id, sampler), loop_config(tmp_path, max_iterations=1))
    await loop.run()
    assert [a[2] for a in sampler.adapters] == [1, 2]
    assert [b.step for b in client.runs[run_id].batches] == [2]


async def test_max_wait(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(status="queued")
    loop = RolloutLoop(
        client, make_engine(run_id, ScriptedSampler(varied)), loop_config(tmp_path, max_wait_s=0.05)
    )
    with pytest.raises(TimeoutError):
        await loop.run()


async def test_queued_run_waits_until_active(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(status="queued", batch_size=4)
    looks = [0]

    def admit_later(fake: FakeRun) -> None:
        looks[0] += 1
        if looks[0] == 4:
            client.update(fake.run.id, status="active")

    client.on_get_run = admit_later
    loop = RolloutLoop(
        client, make_engine(run_id, ScriptedSampler(varied)), loop_config(tmp_path, max_iterations=1)
    )
    await loop.run()
    assert len(client.runs[run_id].batches) == 1 and looks[0] >= 4
    assert client.runs[run_id].heartbeats >= 3  # heartbeats while waiting (no background timer here)


async def test_loads_newest_adapter_and_labels_batches_with_it(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_async_level=100)
    client.runs[run_id].adapters[1] = {"adapter_config.json": b"{}"}
    sampler = ScriptedSampler(varied)

    def publish_step_2(report: StepReport) -> None:
        if report.iteration == 1:
            client.runs[run_id].adapters[2] = {"adapter_config.json": b"{}"}

    loop = RolloutLoop(
        client,
        make_engine(run_id, sampler),
        loop_config(tmp_path, max_iterations=4, keep_adapters=1),
        on_step=[publish_step_2],
    )
    await loop.run()
    adapter_dir = tmp_path / "adapters" / run_id
    assert sampler.adapters == [
        (str(adapter_dir / "step_1"), f"{run_id}-step-1", 1),
        (str(adapter_dir / "step_2"), f"{run_id}-step-2", 2),
    ]
    assert [b.step for b in client.runs[run_id].batches] == [1, 1, 2, 2]
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["step_2"]  # older ones pruned
    assert client.calls.count("fetch_adapter") == 2


async def test_stops_when_the_run_completes_and_reports_progress(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=4, max_steps=3, max_async_level=100)

    def trainer(fake: FakeRun) -> None:
        steps = len(fake.batches)
        client.update(fake.run.id, progress=dataclasses.replace(fake.run.progress, step=steps))
        if steps >= 3:
            client.update(fake.run.id, status="completed")

    client.on_get_run = trainer
    reports: list[StepReport] = []
    engine = make_engine(run_id, ScriptedSampler(varied), val_problems=4)
    loop = RolloutLoop(client, engine, loop_config(tmp_path, val_freq=2), on_step=[reports.append])
    history = await loop.run()
    assert history == reports and len(reports) == 3
    assert [r.runs[run_id].rollout_step for r in reports] == [1, 2, 3]
    assert reports[0].runs[run_id].max_steps == 3
    # Half the answers right (1.0), half "x" (0.1, or 0.3 where the answer has one digit).
    assert len(loop.reward_history["solver"]) == 3
    assert all(0.55 <= r <= 0.65 for r in loop.reward_history["solver"])
    assert [r.validation is not None for r in reports] == [True, False, True]
    assert loop.validation_history[0].success_rate == {"solver": 1.0}  # greedy: the scripted j=0 answer


async def test_lora_mode_runs_get_only_their_agents_batches(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_a = client.add_run(batch_size=4, max_async_level=100)
    run_b = client.add_run(batch_size=4, max_async_level=100)
    client.runs[run_b].adapters[3] = {"adapter_config.json": b"{}"}
    solver, checker = ScriptedSampler(varied), ScriptedSampler(lambda p, j: "yn"[j % 2])
    engine = MultiAgentEngine(
        EngineConfig(
            env="solver_checker",
            specialization=Specialization.LORA,
            problems_per_step=2,
            samples_per_problem=2,
        ),
        {
            "solver": AgentPolicy(run_id=run_a, sampler=solver, tokenizer=TOKENIZER),
            "checker": AgentPolicy(run_id=run_b, sampler=checker, tokenizer=TOKENIZER),
        },
    )
    loop = RolloutLoop(client, engine, loop_config(tmp_path, max_iterations=2))
    await loop.run()
    assert {b.agent for b in client.runs[run_a].batches} == {"solver"}
    assert {b.agent for b in client.runs[run_b].batches} == {"checker"}
    assert [b.step for b in client.runs[run_b].batches] == [3, 3] and solver.adapters == []
    assert [a[2] for a in checker.adapters] == [3]
    assert set(loop.reward_history) == {"solver", "checker"}


async def test_background_heartbeat_and_restart_continuation(tmp_path: Path) -> None:
    client = FakeLoopClient()
    run_id = client.add_run(batch_size=2, max_async_level=100)
    loop = RolloutLoop(
        client,
        make_engine(run_id, ScriptedSampler(varied, delay_s=0.02)),
        loop_config(tmp_path, max_iterations=3, heartbeat_interval_s=0.005),
    )
    await loop.run()
    assert client.runs[run_id].heartbeats > 3  # per iteration, plus the timer during generation
    # A new loop on the same run continues the rollout-step count from the submitted batches.
    again = RolloutLoop(
        client, make_engine(run_id, ScriptedSampler(varied)), loop_config(tmp_path, max_iterations=1)
    )
    await again.run()
    assert again.runs[run_id].submitted_samples == 16 and again.runs[run_id].rollout_step == 8
