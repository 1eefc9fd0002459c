"""The Packer's per-batch accounting (trainer_core/packing/buffer.py) on each of its paths.

`_loss_token_counts` takes one of three paths by how many False values a batch's completion masks hold
(none, a few, many); each must give every sample's loss-carrying token count, and the Packer's
per-run ``loss_tokens`` must equal the True values of the rows' loss masks it builds."""

import numpy as np
import pytest

from contracts.arrays import decode_stored, encode, to_arrays
from contracts.wire import TrainingBatch, TrainingSample
from trainer_core.packing import Packer
from trainer_core.packing.buffer import _loss_token_counts


def _masks(rng: np.random.Generator, n: int, false_share: float) -> list[np.ndarray]:
    return [rng.random(int(rng.integers(0, 50))) >= false_share for _ in range(n)]


@pytest.mark.parametrize("false_share", [0.0, 0.01, 0.5, 1.0])
def test_loss_token_counts_equal_a_per_sample_count(false_share: float) -> None:
    rng = np.random.default_rng(7)
    masks = _masks(rng, 300, false_share)
    joined = np.concatenate(masks).astype(np.bool_)
    n_completion = np.array([m.size for m in masks], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(n_completion))).tolist()
    counts = _loss_token_counts(joined, n_completion, starts)
    assert counts.tolist() == [int(m.sum()) for m in masks]


def _sample(rng: np.random.Generator, mask: np.ndarray) -> TrainingSample:
    n_prompt = int(rng.integers(0, 20))
    n = int(mask.size) or 1
    mask = mask if mask.size else np.ones(1, dtype=np.bool_)
    return TrainingSample(
        prompt_ids=rng.integers(0, 1000, n_prompt).tolist(),
        prompt_mask=[True] * n_prompt,
        completion_ids=rng.integers(0, 1000, n).tolist(),
        completion_mask=mask.tolist(),
        completion_logprobs=(-rng.random(n)).tolist(),
        advantage=float(rng.normal()),
    )


@pytest.mark.parametrize("false_share", [0.0, 0.02, 0.6])
def test_a_packs_loss_tokens_equal_its_rows_loss_masks(false_share: float) -> None:
    rng = np.random.default_rng(3)
    packer = Packer(n_slots=2, seq_len=512, dp_world_size=2, pad_to_multiple_of=16)
    for slot in range(2):
        packer.add_run(slot, batch_size=40)
        batch = TrainingBatch(examples=[_sample(rng, m) for m in _masks(rng, 40, false_share)])
        packer.add_batch(slot, decode_stored(encode(to_arrays(batch))), batch_id=slot)
    total_stats = total_rows = 0
    while (result := packer.pack(force=True)) is not None:
        total_stats += sum(stats.loss_tokens for stats in result.runs.values())
        total_rows += sum(int(mb.loss_mask.sum()) for rank in result.micro_batches for mb in rank)
    assert total_stats == total_rows > 0
