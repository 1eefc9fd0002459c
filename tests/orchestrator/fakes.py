"""Test doubles for the engine and loop tests: a scripted sampler (the DESIGN allows a
fake sampler) and FakeLoopClient, a fake of the few AsyncLoraloomClient methods the
rollout loop calls (the real client is tested against a real HTTP server elsewhere)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from contracts.progress import Progress
from contracts.tokenizer import CharTokenizer
from contracts.wire import TrainingBatch
from orchestrator.errors import Conflict, NotFound, RunEvicted
from orchestrator.models import AdapterDownload, AdapterInfo, BatchInfo, Heartbeat, Page, Run
from orchestrator.samplers.base import Completion

TOKENIZER = CharTokenizer()

Responder = Callable[[str, int], str]
"""(decoded prompt, index of the completion within the call) -> completion text (EOS is appended)."""


@dataclass
class ScriptedSampler:
    """Answers with `responder`'s text; records prompts, concurrency and loaded adapters."""

    responder: Responder
    delay_s: float = 0.0
    prompts: list[str] = field(default_factory=list)
    adapters: list[tuple[str, str, int]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Completion]:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            out = []
            for p in prompts:
                text = TOKENIZER.decode(p)
                for j in range(n):
                    self.prompts.append(text)
                    ids = TOKENIZER.encode(self.responder(text, j))[: max_tokens - 1] + [
                        TOKENIZER.eos_token_id
                    ]
                    out.append(Completion(ids, [-0.1] * len(ids), finish_reason="stop"))
            return out
        finally:
            self.in_flight -= 1

    async def load_adapter(self, path: str | Path, name: str, step: int) -> None:
        self.adapters.append((str(path), name, step))


def solve(prompt: str) -> str:
    """The right answer to the last "a+b=" in `prompt`."""
    question = prompt.split("=")[0].split(" ")[-1]
    return str(sum(int(t) for t in question.split("+")))


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class FakeRun:
    run: Run
    batches: list[TrainingBatch] = field(default_factory=list)
    heartbeats: int = 0
    adapters: dict[int, dict[str, bytes]] = field(default_factory=dict)


class FakeLoopClient:
    """A fake of the AsyncLoraloomClient methods RolloutLoop uses, with the service's
    semantics where the loop depends on them (eviction → 409 RunEvicted, etc.)."""

    def __init__(self) -> None:
        self.runs: dict[str, FakeRun] = {}
        self.evictions: list[tuple[str, str, str]] = []
        self.calls: list[str] = []
        self.on_get_run: Callable[[FakeRun], None] | None = None
        """Called on every get_run: lets a test move the run (progress, eviction) over time."""

    def add_run(self, *, status: str = "active", **config: Any) -> str:
        run_id = "run_" + uuid.uuid4().hex[:12]
        self.runs[run_id] = FakeRun(
            Run(id=run_id, name=run_id, status=status, config=config, progress=Progress())
        )
        return run_id

    def update(self, run_id: str, **changes: Any) -> None:
        fake = self.runs[run_id]
        fake.run = fake.run.model_copy(update=changes)

    def _get(self, run_id: str) -> FakeRun:
        if run_id not in self.runs:
            raise NotFound(f"run {run_id} not found", status=404, code="not_found")
        return self.runs[run_id]

    async def get_run(self, run_id: str) -> Run:
        self.calls.append("get_run")
        fake = self._get(run_id)
        if self.on_get_run is not None:
            self.on_get_run(fake)
        return fake.run

    async def heartbeat(self, run_id: str) -> Heartbeat:
        self.calls.append("heartbeat")
        fake = self._get(run_id)
        fake.heartbeats += 1
        return Heartbeat(run_id=run_id, status=fake.run.status, last_heartbeat_at=_now())

    async def list_adapters(self, run_id: str) -> list[AdapterInfo]:
        self.calls.append("list_adapters")
        return [
            AdapterInfo(step=s, size_bytes=1, sha256=f"sha{s}") for s in sorted(self._get(run_id).adapters)
        ]

    async def latest_adapter(self, run_id: str) -> AdapterInfo | None:
        self.calls.append("latest_adapter")
        steps = self._get(run_id).adapters
        return AdapterInfo(step=max(steps), size_bytes=1, sha256=f"sha{max(steps)}") if steps else None

    async def fetch_adapter(self, run_id: str, step: int, dest_dir: Path) -> AdapterDownload:
        self.calls.append("fetch_adapter")
        dest_dir.mkdir(parents=True, exist_ok=True)
        for name, data in self._get(run_id).adapters[step].items():
            (dest_dir / name).write_bytes(data)
        return AdapterDownload(path=dest_dir, step=step, sha256=f"sha{step}", changed=True)

    async def submit_batch(self, run_id: str, batch: TrainingBatch, *, fmt: str = "msgpack") -> BatchInfo:
        self.calls.append("submit_batch")
        fake = self._get(run_id)
        run = fake.run
        if run.status == "evicted":
            raise RunEvicted(
                "evicted", run_id=run_id, reason=run.eviction_reason, evicted_by=run.evicted_by, status=409
            )
        if run.status != "active":
            raise Conflict(f"run is {run.status}", status=409, code="run_not_active")
        fake.batches.append(batch)
        return BatchInfo(
            id=len(fake.batches),
            run_id=run_id,
            rollout_step=batch.step,
            num_samples=len(batch.examples),
            num_tokens=sum(s.num_tokens for s in batch.examples),
            state="pending",
        )

    async def evict_run(self, run_id: str, reason: str, *, by: str = "user") -> Run:
        self.calls.append("evict_run")
        self.evictions.append((run_id, reason, by))
        self.update(run_id, status="evicted", eviction_reason=reason, evicted_by=by)
        return self.runs[run_id].run

    async def list_batches(
        self, run_id: str, *, state: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> Page[BatchInfo]:
        self.calls.append("list_batches")
        fake = self._get(run_id)
        if fake.run.status == "deleted":  # as the service: a deleted run's batches are a 404
            details = {"run_id": run_id, "status": "deleted"}
            raise NotFound(f"run {run_id} was deleted", status=404, code="not_found", details=details)
        items = [
            BatchInfo(
                id=i,
                run_id=run_id,
                rollout_step=b.step,
                num_samples=len(b.examples),
                num_tokens=0,
                state="pending",
            )
            for i, b in enumerate(fake.batches)
        ]
        return Page[BatchInfo](items=items, next_cursor=None)
