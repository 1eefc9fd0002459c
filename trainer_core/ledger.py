"""Which rollout batches a run's step used, so that each is acknowledged exactly when the
optimizer step that trained its last sample has happened (DESIGN §4.3)."""

from dataclasses import dataclass, field

from contracts.pool_api import AckItem


@dataclass
class _OpenBatch:
    batch_id: int
    remaining: int
    """Samples of this batch not yet packed."""


@dataclass
class RunLedger:
    """One run's batches as the master fed them to the packer, in order."""

    next_sample: int = 0
    """Index (among all the run's samples) of the next sample the packer should receive: the
    run's trained samples when it was admitted, then the end of the last batch claimed."""
    open: list[_OpenBatch] = field(default_factory=list)
    """Batches with samples still buffered in the packer."""
    awaiting_step: list[int] = field(default_factory=list)
    """Batches fully packed whose step has not completed yet."""

    def samples_to_skip(self, *, sample_offset: int) -> int:
        """Leading samples of a batch that were already trained (before the checkpoint we resumed from)."""
        return max(0, self.next_sample - sample_offset)

    def add(self, *, batch_id: int, sample_offset: int, num_samples: int) -> int:
        """Record a claimed batch; returns how many of its samples go to the packer."""
        skip = self.samples_to_skip(sample_offset=sample_offset)
        fresh = max(0, num_samples - skip)
        self.next_sample = max(self.next_sample, sample_offset + num_samples)
        if fresh == 0:
            # Entirely trained before the checkpoint: acknowledge with the next completed step.
            self.awaiting_step.append(batch_id)
        else:
            self.open.append(_OpenBatch(batch_id, fresh))
        return fresh

    def consumed(self, taken: list[tuple[int, int]]) -> None:
        """The packer took these samples: ``(batch id, how many of its samples)``, in packing order."""
        for batch_id, n in taken:
            for entry in self.open:
                if entry.batch_id == batch_id:
                    if n > entry.remaining:
                        raise KeyError(f"{n} samples of batch {batch_id}, which has {entry.remaining} left")
                    entry.remaining -= n
                    break
            else:
                raise KeyError(f"sample of unknown batch {batch_id}")
        self.awaiting_step.extend(b.batch_id for b in self.open if b.remaining == 0)
        self.open = [b for b in self.open if b.remaining > 0]

    def step_completed(self, step: int) -> list[AckItem]:
        """The acknowledgements due now that `step` completed."""
        acks = [AckItem(batch_id=batch_id, trained_step=step) for batch_id in self.awaiting_step]
        self.awaiting_step = []
        return acks
