"""The real PoolTrainer removes a deleted run's files from its checkpoint home, and keeps the others'.

Fed from memory (trainer_core.memory_client): the victim is deleted at the service when the pool
reports its first step (its checkpoint of that step is on the pool's disk by then); a run deleted
while the pool was down has files from before; a run that still exists but is not trained here
(completed, evicted) has files too. The unit tests of the reconcile are test_run_files.py; the real
service and a torchrun pool, tests/e2e/test_pool_run_files_e2e.py.
"""

from pathlib import Path

from contracts.http import Conflict
from contracts.pool_api import RunAfterPush, StepReport
from contracts.run_config import RunConfig
from tests.e2e.helpers import run_config, synthetic_batch
from tests.trainer_core.memory_pool import train_in_memory
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.publish import checkpoint_root

VICTIM, OTHER = "run_000000000000", "run_000000000001"
DELETED_WHILE_DOWN, STILL_THERE = "run_00000000dead", "run_00000000a11e"


class DeletingClient(MemoryPoolClient):
    """The victim's tenant deletes it when the pool reports its first step."""

    def report_step(self, run_id: str, report: StepReport) -> RunAfterPush:
        if run_id == VICTIM:
            self.deleted.add(VICTIM)
            raise Conflict(
                "run is deleted; steps are recorded for active runs only", status=409, code="run_not_active"
            )
        return super().report_step(run_id, report)


def _old_files(home: Path, run_id: str) -> Path:
    step = checkpoint_root(home, run_id) / "step_2"
    step.mkdir(parents=True)
    (step / "adapter.safetensors").write_bytes(b"old weights")
    (step / "STABLE").write_text("2\n")
    return step


def test_a_run_deleted_mid_training_or_while_the_pool_was_down_loses_its_files(tmp_path: Path) -> None:
    home = tmp_path / "ckpt"
    kept = _old_files(home, STILL_THERE)
    _old_files(home, DELETED_WHILE_DOWN)
    config = RunConfig.model_validate(run_config(max_steps=3, seed=5)).model_dump(mode="json")
    batches = [[synthetic_batch(seed + s, n_samples=4) for s in range(3)] for seed in (10, 20)]
    client = DeletingClient(batches, config)
    client.deleted.add(DELETED_WHILE_DOWN)

    train_in_memory(client, tmp_path)

    assert VICTIM in client.deleted and client.runs[OTHER].step == 3
    assert not (home / VICTIM).exists()
    assert not (home / DELETED_WHILE_DOWN).exists()
    assert (kept / "adapter.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in checkpoint_root(home, OTHER).iterdir()) == ["step_1", "step_2", "step_3"]
    # At start-up, one question about the runs with files; then one about each run that left.
    assert client.deleted_queries[0] == sorted([DELETED_WHILE_DOWN, STILL_THERE])
    assert [VICTIM] in client.deleted_queries[1:] and [OTHER] in client.deleted_queries[1:]
