"""Experiment trackers on the rollout loop, offline: TensorBoard event files read back, and a
Weights & Biases run in offline mode, each holding the run's reward and loss series."""

import os
from pathlib import Path

import pytest

from orchestrator.loop import RolloutLoop
from orchestrator.models import Aggregate, StepMetrics
from orchestrator.trackers import TensorBoardLogger, WandbLogger
from tests.orchestrator.fakes import FakeLoopClient, ScriptedSampler
from tests.orchestrator.test_loop import loop_config, make_engine, varied
from tests.orchestrator.wandb_records import history, wait_until_written

LOSSES = {1: 0.9, 2: 0.6, 3: 0.4}


class MetricsClient(FakeLoopClient):
    """The loop's fake client, plus the service's per-step metrics: three trained steps."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics_calls: list[int] = []

    async def get_metrics(self, run_id: str, *, since_step: int = 0) -> list[StepMetrics]:
        self.metrics_calls.append(since_step)
        items = [
            StepMetrics(step=s, loss=loss, grad_norm=0.1 * s, reward=Aggregate(mean=s / 4, std=0.1, count=4))
            for s, loss in LOSSES.items()
        ]
        return [i for i in items if i.step >= since_step]


async def _run_loop(tmp_path: Path, loggers: list) -> str:
    client = MetricsClient()
    run_id = client.add_run(batch_size=4, max_async_level=100)
    engine = make_engine(run_id, ScriptedSampler(varied))
    loop = RolloutLoop(client, engine, loop_config(tmp_path, max_iterations=3, val_freq=2), loggers=loggers)
    await loop.run()
    assert client.metrics_calls[:2] == [0, 4]  # each step is fetched (and logged) once
    return run_id


async def test_tensorboard_event_files(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )

    run_id = await _run_loop(tmp_path, [TensorBoardLogger(tmp_path / "tb")])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    loss = [(e.step, round(e.value, 6)) for e in events.Scalars(f"train/{run_id}/loss")]
    assert loss == [(s, v) for s, v in LOSSES.items()]
    reward = [(e.step, e.value) for e in events.Scalars(f"train/{run_id}/reward_mean")]
    assert reward == [(1, 0.25), (2, 0.5), (3, 0.75)]
    rollout = events.Scalars("rollout/solver/mean_reward")
    assert [e.step for e in rollout] == [0, 1, 2]
    assert all(0.0 <= e.value <= 1.0 for e in rollout)
    assert "validation/solver/success_rate" in tags  # val_freq=2: iterations 0 and 2


async def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install loraloom[wandb])")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    logger = WandbLogger("loraloom-test", name="offline", dir=tmp_path / "wb", mode="offline")
    run_id = await _run_loop(tmp_path, [logger])
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, os.listdir(tmp_path / "wb" / "wandb")
    files = list(runs[0].glob("run-*.wandb"))  # the run's records, as `wandb sync` uploads them
    assert len(files) == 1
    wait_until_written(files[0])
    rows = history(files[0])
    loss = [(r["step"], r[f"train/{run_id}/loss"]) for r in rows if f"train/{run_id}/loss" in r]
    assert loss == list(LOSSES.items())
    reward = [r[f"train/{run_id}/reward_mean"] for r in rows if f"train/{run_id}/reward_mean" in r]
    assert reward == [0.25, 0.5, 0.75]
    assert [r["step"] for r in rows if "rollout/solver/mean_reward" in r] == [0, 1, 2]
