"""The pool resumes runs from their checkpoints (fed from memory; the service's side of a restart is
tested end to end in tests/e2e/test_pool_e2e.py)."""

from pathlib import Path

import pytest
import torch

from contracts.run_config import RunConfig
from tests.e2e.helpers import MODEL_CACHE, run_config, synthetic_batch
from trainer_core.checkpoint import stable_checkpoints
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.worker import PoolTrainer, WorkerArgs

RUN = "run_000000000000"


def train(client: MemoryPoolClient, checkpoint_dir: Path) -> None:
    args = WorkerArgs(
        slots=1,
        seq_len=64,
        max_rank=8,
        checkpoint_dir=checkpoint_dir,
        model_cache_dir=MODEL_CACHE,
        pack_timeout_s=0.05,
        poll_interval_s=0.01,
        exit_when_idle_s=0.3,
    )
    trainer = PoolTrainer(args, world=World(), device=torch.device("cpu"), source=HttpRunSource(client))
    try:
        trainer.run()
    finally:
        trainer.close()


@pytest.mark.timeout(180)
def test_a_run_checkpointed_at_its_last_step_is_reported_complete_not_trained_again(tmp_path: Path) -> None:
    # ckpt.interval 5 > max_steps: only the always-kept checkpoint of the last step is written.
    config = RunConfig.model_validate(run_config(max_steps=2, seed=5, ckpt={"interval": 5})).model_dump(
        mode="json"
    )
    payloads = [[synthetic_batch(1, n_samples=4), synthetic_batch(2, n_samples=4)]]
    first = MemoryPoolClient(payloads, config)
    train(first, tmp_path)
    assert first.runs[RUN].step == 2
    assert [step for step, _ in stable_checkpoints(tmp_path / RUN / "checkpoints")] == [2]

    # The source lost the last step's report (the pool died between checkpoint and report): it still
    # lists the run at step 0 and hands its batches out again. The pool reports the step and stops.
    second = MemoryPoolClient(payloads, config)
    train(second, tmp_path)
    assert second.runs[RUN].step == 2
    assert second.adapters == {}  # nothing trained or uploaded again
    assert second.evictions == {}
