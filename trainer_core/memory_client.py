"""An in-memory stand-in for the service, with the methods of `PoolServiceClient`.

For measuring and testing the trainer alone: claims hand out pre-built batches, pushes
are counted and dropped, nothing is persisted. The service's own behaviour is tested
against the real service; this is only the trainer's input.
"""

import time
from dataclasses import dataclass
from pathlib import Path

from contracts.layout import ADAPTER_WEIGHTS
from trainer_core.service_client import PoolRegistration


@dataclass
class Timing:
    """When training started and ended, and what it trained (for throughput)."""

    first_claim: float | None = None
    last_step: float | None = None
    tokens: int = 0


class MemoryPoolClient:
    """The pool's service client, in memory: the trainer alone, nothing persisted."""

    def __init__(self, payloads: list[list[dict]], config: dict, timing: Timing | None = None) -> None:
        """`payloads[run][k]`: the k-th TrainingBatch (JSON) of run `run_<run as 12 hex>`, all with `config`."""
        self.timing = timing or Timing()
        self.config = config
        self.runs = {f"run_{i:012x}": {"slot": i, "step": 0} for i in range(len(payloads))}
        self.evictions: dict[str, str] = {}
        self.adapters: dict[str, bytes] = {}
        """Each run's latest uploaded adapter_model.safetensors."""
        self.pending = [
            {
                "id": i * 1000 + s,
                "run_id": f"run_{i:012x}",
                "slot": i,
                "sample_offset": s * len(b["examples"]),
                "num_samples": len(b["examples"]),
                "rollout_step": s,
                "payload": b,
            }
            for s in range(len(payloads[0]))
            for i, batches in enumerate(payloads)
            for b in [batches[s]]
        ]
        self.pool_id = "pool_memory"

    def register(self, **_caps) -> PoolRegistration:
        return PoolRegistration(self.pool_id, 3600.0, 3600.0)

    def heartbeat(self) -> None: ...

    def state(self) -> list[dict]:
        return [
            {
                "run_id": r,
                "slot": v["slot"],
                "config": self.config,
                "progress": {"step": v["step"], "total_tokens": 0, "total_samples": 0},
            }
            for r, v in self.runs.items()
            if v["step"] < self.config["max_steps"] and r not in self.evictions
        ]

    def claim(self, max_batches: int) -> list[dict]:
        self.timing.first_claim = self.timing.first_claim or time.perf_counter()
        taken, self.pending = self.pending[:max_batches], self.pending[max_batches:]
        return taken

    def ack(self, acks) -> None: ...

    def restart_run(self, run_id, **_kw) -> list[int]:
        return []

    def upload_adapter(self, run_id, step, adapter_dir: Path) -> None:
        self.adapters[run_id] = (adapter_dir / ADAPTER_WEIGHTS).read_bytes()

    def report_step(self, run_id, *, step, total_tokens, total_samples, metrics) -> dict:
        self.runs[run_id]["step"] = step
        self.timing.last_step = time.perf_counter()
        self.timing.tokens += metrics["tokens"]
        return {}

    def report_checkpoint(self, run_id, **_kw) -> None: ...

    def evict(self, run_id, reason) -> None:
        self.evictions[run_id] = reason

    def close(self) -> None: ...
