"""`SFTLoop`: supervised fine-tuning of a run (``config.loss.kind = "cross_entropy"``) on
(prompt, completion[, weights]) examples, with progress and per-step loss.

Each optimizer step of the run takes ``config.batch_size`` examples: the loop tokenizes them (prompt
with BOS, completion with EOS), sends them as one batch, keeps at most ``ahead`` batches beyond the
trained step (so the service never refuses them as stale), and reports every step the trainer
completes with its loss (the weighted mean cross-entropy). Examples beyond ``max_steps`` batches are
not sent. Logprobs and advantages are not used by the cross_entropy loss: they are sent as 0.

While it waits (for a queued run's slot, or for the trainer) it heartbeats the run: batches are no
sign of life to the service, and a run whose config sets ``heartbeat_timeout`` is evicted after that
long without a heartbeat, queued or active.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from contracts.status import RunStatus
from contracts.tokenizer import Tokenizer, encode_prompt
from contracts.wire import TrainingBatch, TrainingSample
from orchestrator.client import still_queued
from orchestrator.models import BatchInfo, Heartbeat, Run, StepMetrics

__all__ = ["SFTExample", "SFTLoop", "SFTStep"]


@dataclass(frozen=True)
class SFTExample:
    prompt: str
    completion: str
    weights: Sequence[float] | None = None
    """One loss weight per completion token (EOS included); default: 1 on every token."""


@dataclass(frozen=True)
class SFTStep:
    """One trained step of the run."""

    step: int
    loss: float | None
    """The step's weighted mean cross-entropy (nats/token), as the trainer reported it."""
    samples: int
    examples_sent: int
    """Examples sent so far (all steps)."""


class SFTClient(Protocol):
    """What the loop needs of `LoraloomClient`."""

    def get_run(self, run_id: str) -> Run: ...
    def heartbeat(self, run_id: str) -> Heartbeat: ...
    def submit_batch(self, run_id: str, batch: TrainingBatch) -> BatchInfo: ...
    def get_metrics(self, run_id: str) -> list[StepMetrics]: ...


ExampleLike = SFTExample | tuple[str, str] | tuple[str, str, Sequence[float]]


def _as_example(item: ExampleLike) -> SFTExample:
    if isinstance(item, SFTExample):
        return item
    if len(item) == 2:
        return SFTExample(item[0], item[1])
    return SFTExample(item[0], item[1], item[2])


class SFTLoop:
    def __init__(
        self,
        client: SFTClient,
        run_id: str,
        tokenizer: Tokenizer,
        *,
        ahead: int = 2,
        poll_interval_s: float = 0.2,
        timeout_s: float = 600.0,
        heartbeat_interval_s: float = 10.0,
        on_step: Callable[[SFTStep], None] | None = None,
    ) -> None:
        if ahead < 1:
            raise ValueError("ahead must be >= 1")
        if heartbeat_interval_s <= 0:
            raise ValueError("heartbeat_interval_s must be > 0")
        self.client = client
        self.run_id = run_id
        self.tokenizer = tokenizer
        self.ahead = ahead
        self.poll_interval_s = poll_interval_s
        self.timeout_s = timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        """At most this long between heartbeats while waiting (shorter for a run whose heartbeat_timeout
        is less than three times it)."""
        self.on_step = on_step
        self._beat_every = heartbeat_interval_s
        self._next_beat = 0.0
        """time.monotonic() from which the next wait heartbeats again."""

    def encode(self, example: ExampleLike) -> TrainingSample:
        """One training sample: BOS + prompt, completion + EOS, weights on the completion tokens."""
        ex = _as_example(example)
        prompt = encode_prompt(self.tokenizer, ex.prompt)
        completion = list(self.tokenizer.encode(ex.completion)) + [self.tokenizer.eos_token_id]
        if ex.weights is not None and len(ex.weights) != len(completion):
            raise ValueError(
                f"weights has {len(ex.weights)} entries but the completion has {len(completion)} tokens "
                "(EOS included)"
            )
        return TrainingSample(
            prompt_ids=prompt,
            prompt_mask=[False] * len(prompt),
            completion_ids=completion,
            completion_mask=[True] * len(completion),
            completion_logprobs=[0.0] * len(completion),
            advantage=0.0,
            weights=list(ex.weights) if ex.weights is not None else None,
        )

    def run(self, examples: Iterable[ExampleLike]) -> list[SFTStep]:
        """Train on `examples` (one pass, in order) until they or the run's max_steps run out; returns
        every step trained, in order (the last partial batch is not sent)."""
        run = self.client.get_run(self.run_id)
        self._beat_every, self._next_beat = self._heartbeat_interval(run), 0.0
        if run.status == RunStatus.QUEUED:  # its batches are refused (409) until it has a slot
            run = self._active_run()
        config = run.run_config
        if config.loss.kind != "cross_entropy":
            raise ValueError(
                f"run {self.run_id} has loss.kind {config.loss.kind!r}; SFT needs 'cross_entropy'"
            )
        start = run.progress.step
        steps_left = config.max_steps - start
        sent = 0
        reports: list[SFTStep] = []
        for index, batch in enumerate(self._batches(examples, config.batch_size)):
            if index >= steps_left:
                break
            trained = self._wait_for_step(start + index - self.ahead, reports, sent)
            self.client.submit_batch(
                self.run_id,
                TrainingBatch(examples=[self.encode(e) for e in batch], temperature=1.0, step=trained),
            )
            sent += len(batch)
        self._wait_for_step(start + min(steps_left, -(-sent // config.batch_size)), reports, sent)
        return reports

    def _active_run(self) -> Run:
        deadline = time.monotonic() + self.timeout_s
        while still_queued(
            run := self.client.get_run(self.run_id), deadline=deadline, timeout=self.timeout_s
        ):
            self._heartbeat_if_due()
            time.sleep(self.poll_interval_s)
        return run

    def _heartbeat_interval(self, run: Run) -> float:
        """Three beats per heartbeat_timeout at least: one late or lost beat must not evict the run."""
        timeout = run.run_config.heartbeat_timeout
        return self.heartbeat_interval_s if timeout is None else min(self.heartbeat_interval_s, timeout / 3)

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now >= self._next_beat:
            self.client.heartbeat(self.run_id)
            self._next_beat = now + self._beat_every

    @staticmethod
    def _batches(examples: Iterable[ExampleLike], size: int) -> Iterator[list[ExampleLike]]:
        batch: list[ExampleLike] = []
        for example in examples:
            batch.append(example)
            if len(batch) == size:
                yield batch
                batch = []

    def _wait_for_step(self, step: int, reports: list[SFTStep], sent: int) -> int:
        """Wait until the run has trained `step` steps; report the new ones; the trained step."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            run = self.client.get_run(self.run_id)
            run.raise_if_stopped()
            self._report(run.progress.step, reports, sent)
            if not run.is_terminal:  # each call, not only when it waits: a fast trainer never makes it
                self._heartbeat_if_due()
            if run.progress.step >= step or run.is_terminal:
                return run.progress.step
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {self.run_id} did not reach step {step} in {self.timeout_s}s")
            time.sleep(self.poll_interval_s)

    def _report(self, trained: int, reports: list[SFTStep], sent: int) -> None:
        done = reports[-1].step if reports else None
        if trained <= 0 or (done is not None and trained <= done):
            return
        metrics = {m.step: m for m in self.client.get_metrics(self.run_id)}
        for step in sorted(s for s in metrics if (done is None or s > done) and s <= trained):
            report = SFTStep(
                step=step, loss=metrics[step].loss, samples=metrics[step].samples or 0, examples_sent=sent
            )
            reports.append(report)
            if self.on_step is not None:
                self.on_step(report)
