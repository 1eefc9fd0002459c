"""A GAE run through the real pool (`PoolTrainer`, fed from memory): its value head is exported beside the
PEFT files as value_head.safetensors, reloads to the checkpointed tensors, and a run resumed from a
checkpoint ends with exactly the head and adapter of the run that was never interrupted."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from contracts.layout import ADAPTER_WEIGHTS
from contracts.pool_api import AdapterStored
from contracts.run_config import RunConfig
from tests.e2e.helpers import MODEL_CACHE, run_config, synthetic_batch
from trainer_core.checkpoint import load_checkpoint, stable_checkpoints
from trainer_core.critic import VALUE_HEAD_FILE, load_value_head
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.worker import PoolTrainer, WorkerArgs

RUN = "run_000000000000"
STEPS = 3


class RecordingClient(MemoryPoolClient):
    """Keeps every step's exported value head (the files the pool published with the adapter)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heads: dict[int, dict[str, torch.Tensor]] = {}
        self.adapter_steps: dict[int, bytes] = {}

    def upload_adapter(self, run_id: str, step: int, adapter_dir: Path) -> AdapterStored:
        self.heads[step] = load_value_head(adapter_dir / VALUE_HEAD_FILE)
        self.adapter_steps[step] = (adapter_dir / ADAPTER_WEIGHTS).read_bytes()
        return super().upload_adapter(run_id, step, adapter_dir)


def _payloads() -> list[list[dict]]:
    batches = []
    for step in range(STEPS):
        batch = synthetic_batch(10 + step, n_samples=4)
        for i, sample in enumerate(batch["examples"]):
            sample["reward"] = [1.0, -0.5, 0.25, 2.0][i]
            sample["advantage"] = 0.0  # ignored by a GAE run
        batches.append(batch)
    return [batches]


def _config() -> dict:
    return RunConfig.model_validate(
        run_config(
            max_steps=STEPS,
            seed=3,
            optim={"lr": 2e-2},
            ckpt={"interval": 1, "keep_last": 5},
            loss={"kind": "ppo", "kl_ref_coef": 0.05},
            advantage={"estimator": "gae", "gamma": 0.95, "lam": 0.9},
        )
    ).model_dump(mode="json")


def _train(client: MemoryPoolClient, checkpoint_dir: Path) -> None:
    args = WorkerArgs(
        slots=2,
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_value_head_exported_reloaded_and_checkpoint_resumed_exactly(tmp_path: Path) -> None:
    first = RecordingClient(_payloads(), _config())
    _train(first, tmp_path / "a")
    assert first.runs[RUN].step == STEPS
    ckpts = dict(stable_checkpoints(tmp_path / "a" / RUN / "checkpoints"))
    assert sorted(ckpts) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        extra = load_checkpoint(ckpts[step]).extra
        assert extra is not None
        saved = extra["value_head"]
        # Exported beside the PEFT files, and equal to what the checkpoint holds at that step.
        assert set(first.heads[step]) == {"value_head.weight", "value_head.bias"}
        for name, tensor in saved.items():
            assert torch.equal(first.heads[step][name], tensor)
    final = first.heads[STEPS]
    assert float(final["value_head.weight"].abs().max()) > 0  # the critic trained
    assert not torch.equal(first.heads[1]["value_head.weight"], final["value_head.weight"])

    # Resume: a second pool finds only the checkpoints of steps 1 and 2, restores the run (adapter,
    # value head, optimizer) from step 2 and trains step 3 again on the same samples.
    resumed_dir = tmp_path / "b" / RUN / "checkpoints"
    resumed_dir.mkdir(parents=True)
    for step in (1, 2):
        shutil.copytree(ckpts[step], resumed_dir / ckpts[step].name)
    second = RecordingClient(_payloads(), _config())
    _train(second, tmp_path / "b")
    assert second.runs[RUN].step == STEPS
    assert sorted(second.heads) == [STEPS]  # only the last step was trained again
    for name in final:
        assert torch.allclose(second.heads[STEPS][name], final[name], atol=1e-6, rtol=0)
    a = load_file(str(ckpts[STEPS] / "adapter.safetensors"))
    b = load_checkpoint(dict(stable_checkpoints(resumed_dir))[STEPS]).adapter
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
