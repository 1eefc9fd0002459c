"""The rollout loop: sample with the newest adapter, score, filter, submit, repeat.

Each iteration, for every run the engine's agents map to:

1. check the run (`GET /v1/runs/{id}`): evicted → `RunEvicted` with the reason;
   failed/deleted → `RunFailed`; completed → no more batches for it (the loop ends
   when all its runs are completed);
2. heartbeat (every iteration, and on a timer in the background so that long
   generations or waits do not look like a dead orchestrator);
3. wait while the run is queued, or while it is too far ahead of the trainer:
   the next batch belongs to rollout step s = (samples submitted so far) //
   batch_size, the trainer step those samples will be trained in, and it is
   not generated while s - run.progress.step > max_async_level. Waiting before
   generating (not only before submitting) keeps samples as fresh as the
   contract allows;
4. load the newest adapter into the run's sampler(s) when a newer step appears
   (`latest_adapter`, one request, then download to `adapter_dir/<run>/step_N`,
   kept until `keep_adapters` newer ones exist: a vLLM server may read it lazily); when the
   newest one is still more than max_async_level steps behind the trained step
   (its upload trails the step), wait for a fresher one;
5. generate the step's rollouts, compute rewards, filter, advantages
   (`MultiAgentEngine.make_batches`) and submit one batch per run, with the
   adapter step it was sampled with as the batch's `step`;
6. a run whose batch is empty after filtering (no learning signal) three times in
   a row evicts itself (`evict_run(reason, by="orchestrator")`) and the loop raises
   `RunEvicted`, as the source documents' orchestrator does.

Every `val_freq` iterations the engine's validation runs first (success rate per
agent). After each iteration a `StepReport` goes to the `on_step` callbacks (for
progress bars) and into `history`; `reward_history[agent]` is the mean episode
reward per iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from contracts.layout import step_dir_name
from contracts.run_config import RunConfig
from contracts.status import RunStatus
from contracts.wire import TrainingBatch
from orchestrator.client import BatchFormat, EvictedBy
from orchestrator.engine import MultiAgentEngine, Rollouts, RunBatch, ValidationResult
from orchestrator.errors import Conflict, NotFound, RunEvicted, RunFailed
from orchestrator.models import AdapterDownload, AdapterInfo, BatchInfo, Heartbeat, Page, Run
from orchestrator.trackers import TrackerLogger

log = logging.getLogger(__name__)

NO_SIGNAL_REASON = "no learning signal: every sample was filtered out in {n} consecutive batches"


class LoopClient(Protocol):
    """The part of `AsyncLoraloomClient` the loop uses."""

    async def get_run(self, run_id: str) -> Run: ...

    async def heartbeat(self, run_id: str) -> Heartbeat: ...

    async def latest_adapter(self, run_id: str) -> AdapterInfo | None: ...

    async def fetch_adapter(self, run_id: str, step: int, dest_dir: Path) -> AdapterDownload: ...

    async def submit_batch(
        self, run_id: str, batch: TrainingBatch, *, fmt: BatchFormat = "msgpack"
    ) -> BatchInfo: ...

    async def evict_run(self, run_id: str, reason: str, *, by: EvictedBy = "user") -> Run: ...

    async def list_batches(
        self, run_id: str, *, state: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> Page[BatchInfo]: ...


@dataclass(frozen=True)
class LoopConfig:
    max_iterations: int | None = None
    """Stop after this many iterations; None = until every run is completed."""
    adapter_dir: Path = Path(".loraloom/adapters")
    poll_interval_s: float = 1.0
    """How often to re-check a queued run, or one that is too far ahead of the trainer."""
    heartbeat_interval_s: float | None = 10.0
    """Background heartbeat period; None = heartbeat only once per iteration and per poll."""
    max_empty_batches: int = 3
    val_freq: int = 0
    """Validate every this many iterations (and at iteration 0); 0 = never."""
    submit_format: BatchFormat = "msgpack"
    keep_adapters: int = 2
    max_wait_s: float | None = None
    """Give up (TimeoutError) when one wait for the trainer (slot, progress, adapter) lasts longer; None = never."""

    def __post_init__(self) -> None:
        if self.max_empty_batches < 1 or self.keep_adapters < 1:
            raise ValueError("max_empty_batches and keep_adapters must be >= 1")


@dataclass
class RunProgress:
    """The loop's view of one run."""

    run_id: str
    run: Run
    batch_size: int
    max_async_level: int
    max_steps: int
    submitted_samples: int = 0
    adapter_step: int | None = None
    """The adapter the run's sampler uses; None = the base model (no adapter yet)."""
    empty_streak: int = 0
    batches_submitted: int = 0

    @property
    def rollout_step(self) -> int:
        """The trainer step the next submitted sample falls into."""
        return self.submitted_samples // self.batch_size

    @property
    def trained_step(self) -> int:
        return self.run.progress.step

    @property
    def completed(self) -> bool:
        return self.run.status == RunStatus.COMPLETED

    @property
    def must_wait(self) -> bool:
        if self.completed:
            return False
        return (
            self.run.status == RunStatus.QUEUED
            or self.rollout_step - self.trained_step > self.max_async_level
        )


@dataclass
class BatchReport:
    num_samples: int
    num_kept: int
    mean_reward: float
    submitted: bool
    batch_id: str | int | None = None


@dataclass
class StepReport:
    """What one iteration did; handed to progress callbacks."""

    iteration: int
    runs: dict[str, RunProgress]
    batches: dict[str, BatchReport]
    mean_reward: dict[str, float]
    """Mean episode reward per agent."""
    success_rate: dict[str, float]
    validation: ValidationResult | None
    elapsed_s: float


StepCallback = Callable[[StepReport], None]


def _config_value(run: Run, name: str) -> int:
    value = run.config.get(name)
    return int(value) if value is not None else int(RunConfig.model_fields[name].default)


class RolloutLoop:
    def __init__(
        self,
        client: LoopClient,
        engine: MultiAgentEngine,
        config: LoopConfig | None = None,
        *,
        on_step: Sequence[StepCallback] = (),
        loggers: Sequence[TrackerLogger] = (),
    ) -> None:
        """`client`: an `AsyncLoraloomClient` (or anything with the methods of `LoopClient`).
        The runs are the engine's: each agent's policy names its run and sampler. `loggers`:
        experiment trackers (orchestrator/trackers.py), closed when `run()` ends."""
        self.client = client
        self.engine = engine
        self.config = config or LoopConfig()
        self.on_step = list(on_step)
        self.loggers = list(loggers)
        self._logged_steps: dict[str, int] = {}
        """Per run: the next trainer step to fetch for the loggers."""
        self.runs: dict[str, RunProgress] = {}
        self.history: list[StepReport] = []
        self.reward_history: dict[str, list[float]] = {a: [] for a in engine.turn_order}
        self.validation_history: list[ValidationResult] = []

    # ---- run state ----------------------------------------------------------------------------

    async def _submitted_samples(self, run_id: str) -> int:
        total, cursor = 0, None
        for _ in range(100_000):
            try:
                page = await self.client.list_batches(run_id, cursor=cursor)
            except NotFound as exc:
                _raise_if_deleted(exc, run_id)
                raise
            total += sum(b.num_samples for b in page.items)
            cursor = page.next_cursor
            if not cursor:
                break
        return total

    async def _init_runs(self) -> None:
        for run_id in self.engine.run_ids:
            run = await self.client.get_run(run_id)
            run.raise_if_stopped()
            self.runs[run_id] = RunProgress(
                run_id=run_id,
                run=run,
                batch_size=_config_value(run, "batch_size"),
                max_async_level=_config_value(run, "max_async_level"),
                max_steps=_config_value(run, "max_steps"),
                # A restarted loop continues where the last one stopped.
                submitted_samples=await self._submitted_samples(run_id),
            )

    async def _refresh(self) -> None:
        for state in self.runs.values():
            if state.completed:
                continue
            state.run = await self.client.get_run(state.run_id)
            state.run.raise_if_stopped()

    def _open_runs(self) -> list[RunProgress]:
        return [s for s in self.runs.values() if not s.completed]

    # ---- liveness -----------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        for state in self._open_runs():
            try:
                beat = await self.client.heartbeat(state.run_id)
            except RunEvicted as exc:
                exc.run_id = exc.run_id or state.run_id
                raise
            if beat.status == RunStatus.EVICTED:
                # get_run in the next refresh carries the reason; raise from there.
                log.warning("run %s reports status evicted on heartbeat", state.run_id)

    async def _heartbeat_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self._heartbeat()
            except Exception as exc:  # a missed beat is not fatal; the main loop sees real trouble
                log.warning("heartbeat failed: %s", exc)

    async def _pause(self, since: float, what: str) -> None:
        """One poll of a wait: sleep, stay alive, re-read the runs (an eviction ends the wait)."""
        if self.config.max_wait_s is not None and time.monotonic() - since > self.config.max_wait_s:
            raise TimeoutError(f"waited more than {self.config.max_wait_s}s for {what}")
        await asyncio.sleep(self.config.poll_interval_s)
        if self.config.heartbeat_interval_s is None:
            await self._heartbeat()
        await self._refresh()

    async def _wait_until_ready(self) -> None:
        since = time.monotonic()
        while waiting := [s for s in self._open_runs() if s.must_wait]:
            for s in waiting:
                log.debug(
                    "run %s: waiting (status %s, rollout step %d, trained step %d, max_async_level %d)",
                    s.run_id,
                    s.run.status,
                    s.rollout_step,
                    s.trained_step,
                    s.max_async_level,
                )
            await self._pause(since, f"runs {[s.run_id for s in waiting]} to be admitted or trained")

    # ---- adapters -----------------------------------------------------------------------------

    async def _load_newest_adapter(self, state: RunProgress) -> None:
        latest = await self.client.latest_adapter(state.run_id)  # one request, however many are kept
        if latest is None:
            return
        newest = latest.step
        if state.adapter_step is not None and newest <= state.adapter_step:
            return
        run_dir = self.config.adapter_dir / state.run_id
        download = await self.client.fetch_adapter(state.run_id, newest, run_dir / step_dir_name(newest))
        for sampler in self.engine.samplers_of(state.run_id):
            await sampler.load_adapter(download.path, f"{state.run_id}-step-{newest}", newest)
        state.adapter_step = newest
        self._prune_adapters(run_dir)

    async def _sync_adapters(self) -> None:
        """Load each run's newest adapter; wait for one when ours is too old for the service.

        The service refuses a batch whose adapter step lags the trained step by more
        than max_async_level; the trainer records a step before its adapter is
        uploaded, so right after a step the newest adapter may not be listed yet."""
        since = time.monotonic()
        for state in self._open_runs():
            await self._load_newest_adapter(state)
            while (
                not state.completed and state.trained_step - (state.adapter_step or 0) > state.max_async_level
            ):
                await self._pause(since, f"an adapter of run {state.run_id} for step >= {state.trained_step}")
                await self._load_newest_adapter(state)

    def _prune_adapters(self, run_dir: Path) -> None:
        steps = sorted(
            (int(p.name.removeprefix("step_")), p)
            for p in run_dir.glob("step_*")
            if p.is_dir() and p.name.removeprefix("step_").isdigit()
        )
        for _, path in steps[: -self.config.keep_adapters]:
            shutil.rmtree(path, ignore_errors=True)

    # ---- batches ------------------------------------------------------------------------------

    async def _self_evict(self, state: RunProgress) -> None:
        reason = NO_SIGNAL_REASON.format(n=state.empty_streak)
        log.warning("run %s: %s; evicting it", state.run_id, reason)
        await self.client.evict_run(state.run_id, reason, by="orchestrator")
        raise RunEvicted(
            f"run {state.run_id} evicted by the orchestrator: {reason}",
            run_id=state.run_id,
            reason=reason,
            evicted_by="orchestrator",
        )

    async def _submit(self, state: RunProgress, run_batch: RunBatch) -> BatchReport:
        report = BatchReport(
            run_batch.num_samples, run_batch.num_kept, run_batch.mean_reward, submitted=False
        )
        if run_batch.batch is None:
            state.empty_streak += 1
            log.warning("run %s: every sample filtered out (%d in a row)", state.run_id, state.empty_streak)
            if state.empty_streak >= self.config.max_empty_batches:
                await self._self_evict(state)
            return report
        state.empty_streak = 0
        try:
            info = await self.client.submit_batch(
                state.run_id, run_batch.batch, fmt=self.config.submit_format
            )
        except RunEvicted as exc:
            exc.run_id = exc.run_id or state.run_id
            raise
        except Conflict as exc:
            # Not active any more, or the batch is too stale: find out which; only the first is fatal.
            state.run = await self.client.get_run(state.run_id)
            state.run.raise_if_stopped()
            log.warning("run %s: batch refused (%s); dropped", state.run_id, exc)
            return report
        state.submitted_samples += len(run_batch.batch.examples)
        state.batches_submitted += 1
        report.submitted, report.batch_id = True, info.id
        return report

    # ---- the loop -----------------------------------------------------------------------------

    async def run(self) -> list[StepReport]:
        """Run until every run is completed or `max_iterations`; returns the reports."""
        await self._init_runs()
        beat_task = None
        if self.config.heartbeat_interval_s is not None:
            beat_task = asyncio.create_task(self._heartbeat_forever(self.config.heartbeat_interval_s))
        # Problems are drawn from (seed, step): continue the sequence when a loop restarts.
        step_offset = min(s.rollout_step for s in self.runs.values())
        try:
            iteration = 0
            while self.config.max_iterations is None or iteration < self.config.max_iterations:
                report = await self._iterate(iteration, step=step_offset + iteration)
                if report is None:
                    break
                self.history.append(report)
                for callback in self.on_step:
                    callback(report)
                await self._log(report)
                iteration += 1
        finally:
            if self.loggers:
                await self._log_trainer_metrics()  # the steps trained since the last iteration
            for logger in self.loggers:
                logger.close()
            if beat_task is not None:
                beat_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat_task
        return self.history

    async def _iterate(self, iteration: int, *, step: int) -> StepReport | None:
        """One iteration (steps 1-6 of the module docstring); None once every run is completed."""
        started = time.monotonic()
        await self._refresh()
        if not self._open_runs():
            log.info("every run is completed")
            return None
        await self._heartbeat()
        await self._wait_until_ready()
        if not self._open_runs():
            return None
        await self._sync_adapters()

        validation = None
        if self.config.val_freq and iteration % self.config.val_freq == 0:
            validation = await self.engine.validate(step=iteration)
            self.validation_history.append(validation)

        rollouts = await self.engine.generate(step=step)
        batches = await self._submit_all(rollouts)
        mean_reward = rollouts.mean_final_reward()
        for agent in self.engine.turn_order:
            self.reward_history[agent].append(mean_reward.get(agent, float("nan")))
        return StepReport(
            iteration=iteration,
            runs={rid: dataclasses.replace(s) for rid, s in self.runs.items()},
            batches=batches,
            mean_reward=mean_reward,
            success_rate=rollouts.success_rate(),
            validation=validation,
            elapsed_s=time.monotonic() - started,
        )

    async def _submit_all(self, rollouts: Rollouts) -> dict[str, BatchReport]:
        """One batch per open run, sampled with the adapter step the run's sampler holds."""
        adapter_steps = {rid: s.adapter_step or 0 for rid, s in self.runs.items()}
        built = self.engine.make_batches(rollouts, adapter_steps)
        batches: dict[str, BatchReport] = {}
        for run_id, run_batch in built.items():
            state = self.runs[run_id]
            if state.completed:
                continue
            batches[run_id] = await self._submit(state, run_batch)
        return batches

    # ---- experiment trackers ------------------------------------------------------------------

    async def _log(self, report: StepReport) -> None:
        if not self.loggers:
            return
        scalars: dict[str, float] = {}
        for agent, value in report.mean_reward.items():
            scalars[f"rollout/{agent}/mean_reward"] = value
        for agent, value in report.success_rate.items():
            scalars[f"rollout/{agent}/success_rate"] = value
        if report.validation is not None:
            for agent, value in report.validation.mean_reward.items():
                scalars[f"validation/{agent}/mean_reward"] = value
            for agent, value in report.validation.success_rate.items():
                scalars[f"validation/{agent}/success_rate"] = value
        for logger in self.loggers:
            logger.log(scalars, report.iteration)
        await self._log_trainer_metrics()

    async def _log_trainer_metrics(self) -> None:
        """The service's per-step figures of each run (trainer metrics, reward aggregates), each
        step once, at its own step number, under `train/{run_id}/...`."""
        get_metrics = getattr(self.client, "get_metrics", None)
        if get_metrics is None:
            return
        for run_id in self.runs:
            since = self._logged_steps.get(run_id, 0)
            items = await get_metrics(run_id, since_step=since)
            for item in items:
                if item.loss is None and item.step >= self.runs[run_id].trained_step:
                    break  # rewards only, not trained yet: log it (and what follows) once it is
                values = item.model_dump(exclude={"step", "created_at", "reward", "sample_metrics"})
                scalars = {f"train/{run_id}/{k}": v for k, v in values.items() if isinstance(v, int | float)}
                if item.reward is not None:
                    scalars[f"train/{run_id}/reward_mean"] = item.reward.mean
                    scalars[f"train/{run_id}/reward_std"] = item.reward.std
                for logger in self.loggers:
                    logger.log(scalars, item.step)
                self._logged_steps[run_id] = item.step + 1

    def run_sync(self) -> list[StepReport]:
        """`run()` in a fresh event loop, for scripts."""
        return asyncio.run(self.run())


def _raise_if_deleted(exc: NotFound, run_id: str) -> None:
    """A run deleted since it was read answers its batches 404 with `details.status` "deleted":
    the same RunFailed as a run read as deleted (`Run.raise_if_stopped`)."""
    details = exc.details if isinstance(exc.details, dict) else {}
    if details.get("status") == RunStatus.DELETED:
        raise RunFailed(f"run {run_id} is deleted", run_id=run_id, run_status=RunStatus.DELETED) from exc
