"""How far a run has trained: the one definition the service, the pool and the SDK share."""

from dataclasses import dataclass


@dataclass(slots=True)
class Progress:
    """A run's progress. Mutable on purpose: the pool's Packer advances its copy as it packs."""

    step: int = 0
    """Completed optimizer steps (each exactly `batch_size` samples)."""
    total_tokens: int = 0
    """Prompt + completion tokens trained in completed and current steps (no padding)."""
    total_samples: int = 0
    """Samples trained in completed and current steps."""
