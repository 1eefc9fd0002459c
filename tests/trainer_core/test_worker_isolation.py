"""The pool's training step keeps runs apart even when one run's gradients overflow.

A loss can be finite while its backward pass overflows; the shared base-model backward
(masked attention: 0 × Inf) would then spread NaN to every run in the row. The trainer
must evict only the failing run and leave the others exactly as if trained alone.
Runs the real PoolTrainer, fed from memory (the service is tested end to end elsewhere).
Which guard catches the broken run depends on how its tokens are packed (its loss sum, the
backward re-run per run, or the optimizer's gradient check); the two-rank end-to-end test
(tests/e2e/test_pool_e2e.py) is the one whose packing overflowed in the backward pass and
spread NaN to its row mate before `trainer_core.step.backward_isolated` existed.
"""

from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from contracts.run_config import RunConfig
from tests.e2e.helpers import run_config, synthetic_batch
from tests.trainer_core.memory_pool import train_in_memory
from trainer_core.memory_client import MemoryPoolClient


def _train(payloads: list[list[dict]], tmp_path: Path) -> MemoryPoolClient:
    config = RunConfig.model_validate(run_config(max_steps=2, seed=5)).model_dump(mode="json")
    client = MemoryPoolClient(payloads, config)
    train_in_memory(client, tmp_path)
    return client


def test_overflowing_run_is_evicted_and_its_row_mate_is_untouched(tmp_path: Path) -> None:
    good = [synthetic_batch(1, n_samples=4), synthetic_batch(2, n_samples=4)]
    # Finite advantages (the service accepts them) whose loss or gradients overflow in float32.
    broken = [
        synthetic_batch(7, n_samples=4, advantage_scale=3e38),
        synthetic_batch(8, n_samples=4, advantage_scale=3e38),
    ]

    together = _train([broken, good], tmp_path / "together")
    alone = _train([good], tmp_path / "alone")

    assert set(together.evictions) == {"run_000000000000"}
    assert "non-finite" in together.evictions["run_000000000000"]
    mixed = load_safetensors(together.adapters["run_000000000001"])
    solo = load_safetensors(alone.adapters["run_000000000000"])
    # Packed beside another run, the good run's rows have another layout, so its float sums differ
    # in the last bits; Adam turns that into up to ~1e-5 on entries whose gradient is near zero.
    # Poisoning would show as NaN or an eviction, not as 1e-5.
    for key in solo:
        torch.testing.assert_close(mixed[key], solo[key], rtol=0, atol=5e-5)
    assert any(v.abs().max() > 0 for k, v in solo.items() if "lora_B" in k)  # it trained
