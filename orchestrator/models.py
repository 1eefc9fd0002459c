"""Typed views of the service's answers (docs/contracts.md).

Unknown fields are ignored, so a newer service that adds fields does not break
an older SDK; the fields the SDK relies on are required.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from contracts.progress import Progress
from contracts.run_config import RunConfig
from contracts.status import MOVABLE_RUN_STATUSES, RunStatus
from orchestrator.errors import RunEvicted, RunFailed

_TERMINAL_STATUSES = frozenset(RunStatus) - frozenset(MOVABLE_RUN_STATUSES)

T = TypeVar("T")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class Run(_Model):
    id: str
    tenant_id: str | None = None
    name: str
    status: str
    """A `RunStatus` value; kept a plain string so that a newer service's new states parse."""
    slot: int | None = None
    base_model: str | None = None
    config: dict[str, Any] = {}
    progress: Progress = Progress()
    init_from: dict[str, Any] | None = None
    """{"run_id", "step"}: the adapter the run started from, if any."""
    eviction_reason: str | None = None
    evicted_by: str | None = None
    failure_reason: str | None = None
    waiting_reason: str | None = None
    """Why a queued run waits (its tenant's quota, its base model's slots or pool); `get_run` only."""
    created_at: datetime | None = None
    updated_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    last_heartbeat_at: datetime | None = None

    @property
    def run_config(self) -> RunConfig:
        return RunConfig.model_validate(self.config)

    @property
    def is_terminal(self) -> bool:
        return self.status in _TERMINAL_STATUSES

    def raise_if_stopped(self) -> None:
        """Raise `RunEvicted` (with the reason) or `RunFailed` if the run can no longer train."""
        if self.status == RunStatus.EVICTED:
            raise RunEvicted(
                f"run {self.id} was evicted by {self.evicted_by or 'unknown'}: {self.eviction_reason}",
                run_id=self.id,
                reason=self.eviction_reason,
                evicted_by=self.evicted_by,
            )
        if self.status in (RunStatus.FAILED, RunStatus.DELETED):
            why = f": {self.failure_reason}" if self.failure_reason else ""
            raise RunFailed(f"run {self.id} is {self.status}{why}", run_id=self.id, run_status=self.status)


class Page(_Model, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class Heartbeat(_Model):
    run_id: str
    status: str
    last_heartbeat_at: datetime | None = None


class BatchInfo(_Model):
    id: str | int
    run_id: str
    rollout_step: int
    num_samples: int
    num_tokens: int
    state: str
    trained_step: int | None = None
    created_at: datetime | None = None


class AdapterInfo(_Model):
    step: int
    size_bytes: int
    sha256: str
    created_at: datetime | None = None


class Aggregate(_Model):
    """Over the samples of one rollout step (std: population, ddof=0)."""

    mean: float
    std: float
    min: float | None = None
    max: float | None = None
    count: int


class StepMetrics(_Model):
    """One step: the trainer's figures (None while not trained) and the rewards of the rollout
    batches sampled at that step (None if none came with rewards)."""

    step: int
    reward: Aggregate | None = None
    sample_metrics: dict[str, Aggregate] | None = None
    samples_received: int | None = None
    loss: float | None = None
    entropy: float | None = None
    mismatch_kl: float | None = None
    masked_fraction: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    samples: int | None = None
    step_time_s: float | None = None
    created_at: datetime | None = None


class AdapterDownload(_Model):
    """Where a downloaded adapter lies, and whether this call changed it."""

    path: Path
    step: int | None
    sha256: str | None
    changed: bool
    """False when the server answered 304: the directory already held this adapter."""
