"""The real PoolTrainer fed from memory (trainer_core.memory_client): one small CPU pool, trained until
it is idle. The service is tested end to end in tests/e2e; these tests need only the pool's side."""

from pathlib import Path
from typing import Any

import torch

from tests.e2e.helpers import MODEL_CACHE
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.worker import PoolTrainer, WorkerArgs


def memory_trainer(client: MemoryPoolClient, tmp_path: Path, **settings: Any) -> PoolTrainer:
    """A 2-slot CPU pool fed by `client` that exits after 0.3 s idle; `settings`: further `WorkerArgs`.
    The caller runs it and closes it."""
    return PoolTrainer(
        memory_pool_args(tmp_path, **settings),
        world=World(),
        device=torch.device("cpu"),
        source=HttpRunSource(client),
    )


def memory_pool_args(tmp_path: Path, **settings: Any) -> WorkerArgs:
    """`memory_trainer`'s settings, for a trainer built otherwise (another rank's, one that runs
    until stopped: `exit_when_idle_s=None`)."""
    defaults: dict[str, Any] = {"pack_timeout_s": 0.05, "poll_interval_s": 0.01, "exit_when_idle_s": 0.3}
    return WorkerArgs(
        url="memory",
        token="memory",
        slots=2,
        seq_len=64,
        max_rank=8,
        checkpoint_dir=tmp_path / "ckpt",
        model_cache_dir=MODEL_CACHE,
        **(defaults | settings),
    )


def train_in_memory(client: MemoryPoolClient, tmp_path: Path, **settings: Any) -> PoolTrainer:
    """Train every run of `client` on a 2-slot pool until nothing is left (exits after 0.3 s idle).
    An exception from `run()` is the pool dying: it propagates. `settings`: further `WorkerArgs`."""
    trainer = memory_trainer(client, tmp_path, **settings)
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer
