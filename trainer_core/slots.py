"""What the pool holds for one active run: its `RunSlot`.

A run gets a slot when the pool admits it and gives it back when the pool releases it (both
explicit calls of `PoolTrainer`, on every rank in the same order). The record keeps the run's
config, its progress (the one copy: the master's Packer advances it as it packs), its step's
metrics and its batch ledger. The slot's adapter and optimizer live in the shared `MultiLoRA` and
`MultiRunOptimizer` under the same slot index.
"""

import time
from dataclasses import dataclass, field

from contracts.pool_api import StepMetricsIn
from contracts.progress import Progress
from contracts.run_config import RunConfig
from trainer_core.ledger import RunLedger
from trainer_core.loss import SlotLossStats
from trainer_core.optim import StepStats
from trainer_core.packing import RunPackStats


@dataclass
class StepAccumulator:
    """A run's loss statistics and sizes summed over the packs of its current step (master only)."""

    created: float = field(default_factory=lambda: time.monotonic())  # looked up per call (tests)
    """When the previous step ended, or the run was admitted (or its manual state dropped)."""
    started: float | None = None
    """When the step's first pack (a manual run: its first forward_backward) was made: its data was there, and the previous step had ended (a
    pack that completes a step takes nothing of the next). Not `created`: after an admission (a pool
    (re)start) that is the wait for the run's first batch, which is no part of the step. None
    before its first pack."""
    loss_sum: float = 0.0
    loss_tokens: int = 0
    """Tokens that carried loss."""
    normaliser: float = 0.0
    """The loss's normaliser: `loss_tokens`, or the sum of the tokens' weights (cross_entropy)."""
    masked_tokens: int = 0
    """Loss-mask tokens whose importance ratio left the bounds (no loss, but scored)."""
    entropy_sum: float = 0.0
    """Summed over every scored token: the loss tokens and the masked ones."""
    mismatch_kl_sum: float = 0.0
    """Summed over every scored token, as `entropy_sum`."""
    tokens: int = 0
    samples: int = 0
    pack_tokens: int = 0
    """Real tokens (every run's) of the packs this step took part in: the pool's throughput."""
    pack_capacity: int = 0
    """Row capacity of those packs (real tokens + padding)."""

    def begin(self) -> None:
        """The step's work starts now, unless it has already: its first pack, or for a manual run
        (trainer_core.manual) its first forward_backward."""
        if self.started is None:
            self.started = time.monotonic()

    def add_pack(self, pack: RunPackStats, *, fill: tuple[int, int] = (0, 0)) -> None:
        self.begin()
        self.tokens += pack.tokens
        self.samples += pack.samples
        self.pack_tokens += fill[0]
        self.pack_capacity += fill[1]

    def add_loss(self, stats: SlotLossStats) -> None:
        self.loss_sum += stats.loss_sum
        self.loss_tokens += stats.loss_tokens
        self.normaliser += stats.normaliser
        self.masked_tokens += stats.masked_tokens
        self.entropy_sum += stats.entropy_sum
        self.mismatch_kl_sum += stats.mismatch_kl_sum

    def metrics(self, step: StepStats) -> StepMetricsIn:
        """The step's metrics: the loss is a mean over the tokens that carried loss; entropy and
        mismatch KL are means over every scored token (they are summed over masked tokens too)."""
        scored = self.loss_tokens + self.masked_tokens
        # A step with no pack and no forward_backward (an optim_step alone) is timed from `created`.
        elapsed = time.monotonic() - (self.created if self.started is None else self.started)
        return StepMetricsIn(
            loss=self.loss_sum / self.normaliser if self.normaliser > 0 else 0.0,
            entropy=self.entropy_sum / max(scored, 1),
            mismatch_kl=self.mismatch_kl_sum / max(scored, 1),
            masked_fraction=self.masked_tokens / max(scored, 1),
            grad_norm=step.grad_norm,
            lr=step.lr,
            tokens=self.tokens,
            samples=self.samples,
            step_time_s=elapsed,
            tokens_per_s=self.pack_tokens / elapsed if self.pack_tokens and elapsed > 0 else None,
            pack_efficiency=self.pack_tokens / self.pack_capacity if self.pack_capacity else None,
        )


@dataclass
class ManualBoundary:
    """A manual run's last optim_step whose update its adapter holds; saved in its checkpoint, so a
    pool restoring the run knows which re-delivered requests that checkpoint already contains."""

    seq_id: int
    """The optim_step's seq_id: every request of the run up to it is in the checkpoint."""
    metrics: dict[str, float]
    """Its result (grad_norm, lr, step), reported again if its report was lost with the pool."""


@dataclass
class RunSlot:
    """One active run in one slot."""

    slot: int
    run_id: str
    config: RunConfig
    progress: Progress
    """Where the run stands: from its checkpoint when admitted; on the master the Packer advances
    this very object as it packs (other ranks do not need it)."""
    ledger: RunLedger = field(default_factory=RunLedger)
    """Master: the batches fed to the packer and not yet acknowledged."""
    step_metrics: StepAccumulator = field(default_factory=StepAccumulator)
    """Master: the current step's metrics so far."""
    manual_boundary: ManualBoundary | None = None
    """Manual runs: the last optim_step applied (from the checkpoint when admitted); None before any."""
    leaving: str | None = None
    """Master: why this run no longer trains (evicted, completed); its slot is released on every
    rank at the next synchronisation, and nothing more is fed or published for it until then."""

    def finish_step(self, step: StepStats) -> StepMetricsIn:
        """The metrics of the step that just completed; the next step accumulates from zero."""
        metrics = self.step_metrics.metrics(step)
        self.step_metrics = StepAccumulator()
        return metrics
