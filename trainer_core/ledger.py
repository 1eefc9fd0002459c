"""Which rollout batches a step used, so that each is acknowledged exactly when the
optimizer step that trained its last sample has happened (DESIGN §4.3)."""

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class _OpenBatch:
    batch_id: int
    remaining: int
    """Samples of this batch not yet packed."""


@dataclass
class BatchLedger:
    """Master-rank bookkeeping: batches fed to the packer, per slot, in order."""

    open: dict[int, list[_OpenBatch]] = field(default_factory=lambda: defaultdict(list))
    awaiting_step: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    """Batches fully packed whose step has not completed yet."""
    next_sample: dict[int, int] = field(default_factory=dict)
    """Index (among all the run's samples) of the next sample the packer should receive."""

    def reset_slot(self, slot: int, *, next_sample: int) -> None:
        self.open.pop(slot, None)
        self.awaiting_step.pop(slot, None)
        self.next_sample[slot] = next_sample

    def samples_to_skip(self, slot: int, *, sample_offset: int) -> int:
        """Leading samples of a batch that were already trained (before the checkpoint we resumed from)."""
        return max(0, self.next_sample.get(slot, 0) - sample_offset)

    def add(self, slot: int, *, batch_id: int, sample_offset: int, num_samples: int) -> int:
        """Record a claimed batch; returns how many of its samples go to the packer."""
        skip = self.samples_to_skip(slot, sample_offset=sample_offset)
        fresh = max(0, num_samples - skip)
        self.next_sample[slot] = max(self.next_sample.get(slot, 0), sample_offset + num_samples)
        if fresh == 0:
            # Entirely trained before the checkpoint: acknowledge with the next completed step.
            self.awaiting_step[slot].append(batch_id)
        else:
            self.open[slot].append(_OpenBatch(batch_id, fresh))
        return fresh

    def consumed(self, slot: int, batch_ids: list[int]) -> None:
        """The packer took these samples (one batch id per sample, in packing order)."""
        for batch_id in batch_ids:
            for entry in self.open[slot]:
                if entry.batch_id == batch_id:
                    entry.remaining -= 1
                    break
            else:
                raise KeyError(f"slot {slot}: sample of unknown batch {batch_id}")
        done = [b for b in self.open[slot] if b.remaining == 0]
        self.open[slot] = [b for b in self.open[slot] if b.remaining > 0]
        self.awaiting_step[slot].extend(b.batch_id for b in done)

    def step_completed(self, slot: int, step: int) -> list[tuple[int, int]]:
        """(batch_id, trained_step) pairs to acknowledge now."""
        ids = self.awaiting_step.pop(slot, [])
        return [(batch_id, step) for batch_id in ids]
