"""An in-memory stand-in for the service, with the methods of `PoolServiceClient`.

For measuring and testing the trainer alone: claims hand out pre-built batches, pushes
are counted and dropped, nothing is persisted. The service's own behaviour is tested
against the real service; this is only the trainer's input.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from contracts.layout import ADAPTER_WEIGHTS
from contracts.pool_api import (
    AckItem,
    AdapterStored,
    CheckpointReport,
    ClaimedBatchStruct,
    PoolHeartbeatOut,
    PoolRegister,
    PoolRegistered,
    PoolRunState,
    RunAfterPush,
    StepReport,
)
from contracts.progress import Progress
from contracts.status import RunStatus
from contracts.wire import TrainingBatch


@dataclass
class Timing:
    """When training started and ended, and what it trained (for throughput)."""

    first_claim: float | None = None
    last_step: float | None = None
    tokens: int = 0


@dataclass
class _MemoryRun:
    slot: int
    step: int = 0


class MemoryPoolClient:
    """The pool's service client, in memory: the trainer alone, nothing persisted."""

    def __init__(
        self, payloads: list[list[dict[str, Any]]], config: dict[str, Any], timing: Timing | None = None
    ) -> None:
        """`payloads[run][k]`: the k-th TrainingBatch (JSON) of run `run_<run as 12 hex>`, all with `config`."""
        self.timing = timing or Timing()
        self.config = config
        self.runs = {f"run_{i:012x}": _MemoryRun(slot=i) for i in range(len(payloads))}
        self.evictions: dict[str, str] = {}
        self.failures: dict[str, str] = {}
        """Runs the pool failed (`fail`), with the reason."""
        self.deleted: set[str] = set()
        """Runs a test deleted: `deleted_runs` names them (nothing else is deleted in memory)."""
        self.deleted_queries: list[list[str]] = []
        """Every `deleted_runs` question, as asked."""
        self.adapters: dict[str, bytes] = {}
        """Each run's latest uploaded adapter_model.safetensors."""
        self.pending = [
            ClaimedBatchStruct(
                id=i * 1000 + s + 1,  # database ids start at 1 (AckItem.batch_id >= 1)
                run_id=f"run_{i:012x}",
                slot=i,
                sample_offset=sum(len(b["examples"]) for b in batches[:s]),
                num_samples=len(batches[s]["examples"]),
                rollout_step=s,
                payload=msgspec.convert(batches[s], TrainingBatch),
            )
            for s in range(len(payloads[0]))
            for i, batches in enumerate(payloads)
        ]
        self.pool_id = "pool_memory"

    def register(self, capabilities: PoolRegister) -> PoolRegistered:
        return PoolRegistered(pool_id=self.pool_id, heartbeat_interval_s=3600.0, lease_seconds=3600.0)

    def deregister(self) -> None: ...

    def heartbeat(self) -> PoolHeartbeatOut:
        return PoolHeartbeatOut(status="alive")

    def state(self) -> list[PoolRunState]:
        return [
            PoolRunState(
                run_id=run_id,
                slot=run.slot,
                status=RunStatus.ACTIVE,
                config=self.config,
                progress=Progress(step=run.step),
            )
            for run_id, run in self.runs.items()
            if run.step < self.config["max_steps"]
            and run_id not in self.evictions
            and run_id not in self.failures
            and run_id not in self.deleted
        ]

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        """The first `max_batches` pending batches (of the runs `run_ids` names; None: of any run)."""
        self.timing.first_claim = self.timing.first_claim or time.perf_counter()
        wanted = [b for b in self.pending if run_ids is None or b.run_id in run_ids][:max_batches]
        taken = {b.id for b in wanted}
        self.pending = [b for b in self.pending if b.id not in taken]
        return wanted

    def ack(self, acks: list[AckItem]) -> int:
        return len(acks)

    def restart_run(
        self, run_id: str, *, checkpoint_step: int, total_samples: int, total_tokens: int
    ) -> list[int]:
        return []

    def upload_adapter(self, run_id: str, step: int, adapter_dir: Path) -> AdapterStored:
        self.adapters[run_id] = (adapter_dir / ADAPTER_WEIGHTS).read_bytes()
        return AdapterStored(step=step, size_bytes=len(self.adapters[run_id]), sha256="")

    def report_step(self, run_id: str, report: StepReport) -> RunAfterPush:
        self.runs[run_id].step = report.step
        self.timing.last_step = time.perf_counter()
        self.timing.tokens += report.metrics.tokens or 0
        done = report.step >= self.config["max_steps"]
        return RunAfterPush(
            id=run_id,
            status=RunStatus.COMPLETED if done else RunStatus.ACTIVE,
            progress=Progress(
                step=report.step, total_tokens=report.total_tokens, total_samples=report.total_samples
            ),
        )

    def report_checkpoint(self, run_id: str, report: CheckpointReport) -> None: ...

    def evict(self, run_id: str, reason: str) -> RunAfterPush | None:
        self.evictions[run_id] = reason
        return None

    def fail(self, run_id: str, reason: str) -> RunAfterPush | None:
        self.failures[run_id] = reason
        return None

    def deleted_runs(self, run_ids: list[str]) -> list[str]:
        self.deleted_queries.append(list(run_ids))
        return sorted(set(run_ids) & self.deleted)

    def init_adapter(self, run_id: str) -> bytes:
        raise KeyError(f"run {run_id} has no init_from in memory")

    def close(self) -> None: ...
