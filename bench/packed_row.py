"""One packed row of equal-length sequences, built by the worker's own `Packer` (the benches' packed input)."""

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from trainer_core.packing import MicroBatch


def packed_row(ids: torch.Tensor, n_slots: int) -> "MicroBatch":
    """The (S, n) sequences as one row of S·n tokens: slot i gets sequences i·S/N … (i+1)·S/N - 1, each a
    1-token prompt and an (n - 1)-token completion, every completion token a loss token."""
    from contracts.wire import TrainingBatch, TrainingSample
    from trainer_core.packing import Packer

    n_seqs, n = ids.shape
    per_slot = n_seqs // n_slots
    packer = Packer(n_slots=n_slots, seq_len=ids.numel(), dp_world_size=1)
    for slot in range(n_slots):
        rows = ids[slot * per_slot : (slot + 1) * per_slot].tolist()
        samples = [
            TrainingSample(
                prompt_ids=r[:1],
                prompt_mask=[True],
                completion_ids=r[1:],
                completion_mask=[True] * (n - 1),
                completion_logprobs=[0.0] * (n - 1),
                advantage=1.0,
            )
            for r in rows
        ]
        packer.add_run(slot, batch_size=per_slot)
        packer.add_batch(slot, TrainingBatch(examples=samples), batch_id=slot)
    packed = packer.pack(force=True)
    assert packed is not None
    ((row,),) = packed.micro_batches
    assert row.num_tokens == ids.numel() and row.num_samples == n_seqs
    return row
