"""What leaves the pool after a run's step (master only): its adapter, its checkpoint, the step
report and the acknowledgements of the batches the step used, in that order, through the run source.

The order is the exactly-once contract (DESIGN §4.3, docs/contracts.md): a batch is acknowledged
only after the step that trained its last sample is reported, and a checkpoint records
`total_samples` at a step boundary, so a restart from it knows which samples to skip.
"""

import logging
import tempfile
from dataclasses import asdict
from pathlib import Path

from contracts.layout import CHECKPOINTS_DIR
from contracts.pool_api import CheckpointReport, StepReport
from contracts.progress import Progress
from trainer_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_core.critic import ValueHeads, save_value_head, uses_critic
from trainer_core.export import export_peft_adapter
from trainer_core.lora import MultiLoRA
from trainer_core.optim import MultiRunOptimizer, StepStats
from trainer_core.runs import RunSource
from trainer_core.slots import ManualBoundary, RunSlot

log = logging.getLogger("loraloom.worker")

MANUAL_BOUNDARY = "manual_boundary"
"""The checkpoint's `extra` entry of a manual run (slots.ManualBoundary)."""


def checkpoint_root(checkpoint_dir: Path, run_id: str) -> Path:
    """A run's checkpoints: `{checkpoint_dir}/{run_id}/checkpoints/step_N` (the run directory layout)."""
    return checkpoint_dir / run_id / CHECKPOINTS_DIR


def restore_slot(
    *,
    lora: MultiLoRA,
    optimizer: MultiRunOptimizer,
    slot: int,
    checkpoint_dir: Path,
    run_id: str,
    value_heads: ValueHeads | None = None,
) -> Progress:
    """Load the run's newest checkpoint into its slot (adapter, optimizer, schedule); its progress.

    Every rank calls it for a run it admits: the adapter and the optimizer state are per rank.
    A run without a checkpoint starts from zero.
    """
    path = latest_checkpoint(checkpoint_root(checkpoint_dir, run_id))
    if path is None:
        return Progress()
    ckpt = load_checkpoint(path)
    lora.load_slot_state_dict(slot, ckpt.adapter)
    if value_heads is not None and ckpt.extra is not None and "value_head" in ckpt.extra:
        value_heads.load_slot_state_dict(slot, ckpt.extra["value_head"])
    optimizer.load_state_dict(slot, ckpt.optimizer_state)
    return Progress(**ckpt.progress)


def restore_manual_boundary(checkpoint_dir: Path, run_id: str) -> ManualBoundary | None:
    """The last optim_step a manual run's newest checkpoint holds; None without one."""
    path = latest_checkpoint(checkpoint_root(checkpoint_dir, run_id))
    extra = None if path is None else load_checkpoint(path).extra
    if extra is None or MANUAL_BOUNDARY not in extra:
        return None
    saved = extra[MANUAL_BOUNDARY]
    return ManualBoundary(
        seq_id=int(saved["seq_id"]), metrics={k: float(v) for k, v in saved["metrics"].items()}
    )


class Publisher:
    """Pushes a run's completed step to the run source (the service, or the run's directory)."""

    def __init__(
        self,
        *,
        source: RunSource,
        lora: MultiLoRA,
        optimizer: MultiRunOptimizer,
        base_model: str,
        checkpoint_dir: Path,
        value_heads: ValueHeads | None = None,
    ) -> None:
        self.value_heads = value_heads
        self.source = source
        self.lora = lora
        self.optimizer = optimizer
        self.base_model = base_model
        self.checkpoint_dir = checkpoint_dir

    def publish_step(self, run: RunSlot, step: int, step_stats: StepStats) -> None:
        """Adapter, checkpoint (every `ckpt.interval` steps and at the last step), step report, acks."""
        metrics = run.finish_step(step_stats)
        # The Packer never takes samples past a step boundary in the pack that completes a step:
        # right now the run's progress is exactly the end of `step`.
        progress = run.progress
        with tempfile.TemporaryDirectory(prefix=f"{run.run_id}-step{step}-") as tmp:
            adapter_dir = export_peft_adapter(
                self.lora, run.slot, Path(tmp) / "adapter", base_model_name_or_path=self.base_model
            )
            if self.value_heads is not None and uses_critic(run.config):
                save_value_head(self.value_heads, run.slot, adapter_dir)
            self.source.publish_adapter(run.run_id, step, adapter_dir)
        # A manual run checkpoints every step: the next pool rebuilds a crashed step from there,
        # replaying that step's requests (app.tinker.leases).
        if (
            step % run.config.ckpt.interval == 0
            or step >= run.config.max_steps
            or run.config.mode == "manual"
        ):
            self.checkpoint(run, step)
        self.source.report_step(
            run.run_id,
            StepReport(
                step=step,
                total_tokens=progress.total_tokens,
                total_samples=progress.total_samples,
                metrics=metrics,
            ),
        )
        self.source.ack(run.ledger.step_completed(step))
        log.info(
            "run %s step %d: loss %.4f, entropy %.4f, grad norm %.4f, lr %.3g, %d samples",
            run.run_id,
            step,
            metrics.loss,
            metrics.entropy,
            step_stats.grad_norm,
            step_stats.lr,
            metrics.samples,
        )

    def report_completed(self, run: RunSlot) -> None:
        """Report the run's last step again, from its checkpoint (its metrics were not kept)."""
        progress = run.progress
        self.source.report_step(
            run.run_id,
            StepReport(
                step=progress.step, total_tokens=progress.total_tokens, total_samples=progress.total_samples
            ),
        )

    def checkpoint(self, run: RunSlot, step: int) -> None:
        """The run's adapter, optimizer and progress at the end of `step`, then its record at the source.

        The last step is always checkpointed: a run whose newest checkpoint reached `max_steps` is
        complete (the directory source knows no other record of it)."""
        extra: dict[str, object] = {}
        if self.value_heads is not None and uses_critic(run.config):
            extra["value_head"] = self.value_heads.slot_state_dict(run.slot)
        if run.manual_boundary is not None:
            extra[MANUAL_BOUNDARY] = asdict(run.manual_boundary)
        save_checkpoint(
            checkpoint_root(self.checkpoint_dir, run.run_id),
            step,
            adapter=self.lora.slot_state_dict(run.slot),
            optimizer_state=self.optimizer.state_dict(run.slot),
            extra=extra or None,
            progress={
                "step": step,
                "total_tokens": run.progress.total_tokens,
                "total_samples": run.progress.total_samples,
            },
            keep_last=run.config.ckpt.keep_last,
        )
        self.source.report_checkpoint(
            run.run_id, CheckpointReport(step=step, total_samples=run.progress.total_samples)
        )
