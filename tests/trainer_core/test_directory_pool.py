"""The pool over run directories, in process (one rank, the built-in tiny model): runs train to
completion from their rollout files, and a pool stopped mid-run resumes from the run's checkpoint,
reads the batches after it again and ends with the adapter of an uninterrupted run (exactly-once).

The same through `loraloom worker --runs-dir` with two ranks: tests/e2e/test_runs_dir_e2e.py.
"""

import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import tomli_w
import torch
from safetensors.torch import load_file

from contracts.layout import ADAPTER_WEIGHTS, STABLE_MARKER
from contracts.wire import TrainingBatch
from tests.e2e.helpers import MODEL_CACHE, run_config, synthetic_batch
from trainer_core.checkpoint import stable_checkpoints
from trainer_core.directory_source import write_rollout_step
from trainer_core.dist import World
from trainer_core.worker import PoolTrainer, WorkerArgs

RUN_A = "run_aaaaaaaaaaaa"
RUN_B = "run_bbbbbbbbbbbb"


def make_run(root: Path, run_id: str, config: dict[str, Any]) -> Path:
    control = root / run_id / "control"
    control.mkdir(parents=True)
    (control / "orch.toml").write_text(tomli_w.dumps(config))
    return root / run_id


def write_steps(run_dir: Path, seeds: list[int], *, first_step: int = 0) -> None:
    """One rollout step per seed, each one batch of 2 samples."""
    for k, seed in enumerate(seeds):
        payload = msgspec.convert(synthetic_batch(seed, n_samples=2), TrainingBatch)
        write_rollout_step(run_dir, first_step + k, [payload])


def pool(root: Path, *, exit_when_idle_s: float | None = 0.3) -> PoolTrainer:
    args = WorkerArgs(
        runs_dir=root,
        slots=2,
        seq_len=64,
        max_rank=8,
        model_cache_dir=MODEL_CACHE,
        pack_timeout_s=0.05,
        poll_interval_s=0.01,
        exit_when_idle_s=exit_when_idle_s,
    )
    return PoolTrainer(args, world=World(), device=torch.device("cpu"))


def train(root: Path) -> None:
    trainer = pool(root)
    try:
        trainer.run()
    finally:
        trainer.close()


def adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    step_dir = run_dir / "broadcast" / f"step_{step}"
    assert (step_dir / STABLE_MARKER).is_file()
    return load_file(step_dir / ADAPTER_WEIGHTS)


def published_steps(run_dir: Path) -> list[int]:
    broadcast = run_dir / "broadcast"
    return sorted(
        int(p.name.removeprefix("step_")) for p in broadcast.glob("step_*") if (p / STABLE_MARKER).exists()
    )


def test_two_runs_train_to_completion_and_are_not_trained_again(tmp_path: Path) -> None:
    a = make_run(tmp_path, RUN_A, run_config(max_steps=3, batch_size=2, seed=1))
    b = make_run(tmp_path, RUN_B, run_config(max_steps=2, batch_size=4, seed=2))
    write_steps(a, [11, 12, 13])
    write_steps(b, [21, 22, 23, 24])
    train(tmp_path)

    assert published_steps(a) == [1, 2, 3] and published_steps(b) == [1, 2]
    assert [step for step, _ in stable_checkpoints(a / "checkpoints")][-1] == 3  # the last step, always
    final_a = adapter(a, 3)
    assert any(v.abs().max() > 0 for k, v in final_a.items() if "lora_B" in k)  # it trained

    write_steps(a, [14], first_step=3)  # more data for a complete run: not trained
    train(tmp_path)
    assert published_steps(a) == [1, 2, 3]
    torch.testing.assert_close(adapter(a, 3), final_a, rtol=0, atol=0)


def test_a_restarted_pool_resumes_from_the_checkpoint_exactly_once(tmp_path: Path) -> None:
    config = run_config(max_steps=4, batch_size=2, seed=3, ckpt={"interval": 2, "keep_last": 2})
    seeds = [31, 32, 33, 34]
    reference = make_run(tmp_path / "reference", RUN_A, config)
    write_steps(reference, seeds)
    train(tmp_path / "reference")
    assert published_steps(reference) == [1, 2, 3, 4]

    # The same run, stopped after step 3 (checkpoint at step 2), then given its last step's data.
    run = make_run(tmp_path / "stopped", RUN_A, config)
    write_steps(run, seeds[:3])
    trainer = pool(tmp_path / "stopped", exit_when_idle_s=None)
    thread = threading.Thread(target=trainer.run)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not (run / "broadcast" / "step_3" / STABLE_MARKER).exists():
            assert thread.is_alive() and time.monotonic() < deadline, "step 3 never came"
            time.sleep(0.05)
    finally:
        trainer.stop_requested = True
        thread.join(timeout=60)
        trainer.close()
    assert [step for step, _ in stable_checkpoints(run / "checkpoints")] == [2]
    first_step_3 = adapter(run, 3)

    write_steps(run, seeds[3:], first_step=3)
    train(tmp_path / "stopped")  # resumes at step 2: reads the rollouts again, skips steps 1-2's samples
    assert published_steps(run) == [1, 2, 3, 4]
    for key, value in adapter(reference, 4).items():
        torch.testing.assert_close(adapter(run, 4)[key], value, rtol=0, atol=1e-5)
        torch.testing.assert_close(first_step_3[key], adapter(reference, 3)[key], rtol=0, atol=1e-5)
