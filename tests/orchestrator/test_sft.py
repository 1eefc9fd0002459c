"""`SFTLoop` against an in-memory client whose "trainer" completes a step per batch: batching by the run's
batch_size, tokenization (BOS prompt, EOS-terminated completion, weights), the max_steps cap, staying
within `ahead` steps of the trained step, and one report per trained step with its loss."""

import pytest

from contracts.run_config import RunConfig
from contracts.tokenizer import CharTokenizer
from contracts.wire import TrainingBatch
from orchestrator.models import BatchInfo, Heartbeat, Progress, Run, StepMetrics
from orchestrator.sft import SFTExample, SFTLoop

RUN = "run_aaaaaaaaaaaa"
TOKENIZER = CharTokenizer()


class TrainerClient:
    def __init__(self, config: RunConfig, queued_polls: int = 0) -> None:
        self.config = config
        self.queued_polls = queued_polls  # polls answered "queued" (waiting for a slot) first
        self.step = 0
        self.batches: list[TrainingBatch] = []
        self.max_lead = 0
        self.heartbeats: list[str] = []
        """The run's status as the "service" saw it at each heartbeat."""
        self.status = "queued" if queued_polls else "active"

    def get_run(self, run_id: str) -> Run:
        if self.queued_polls > 0:
            self.queued_polls -= 1
            return Run(id=run_id, name="sft", status="queued", config=self.config.model_dump(mode="json"))
        self.status = "active"
        # Each poll lets the "trainer" finish one pending batch.
        if self.step < len(self.batches):
            self.step += 1
        status = "completed" if self.step >= self.config.max_steps else "active"
        return Run(
            id=run_id,
            name="sft",
            status=status,
            config=self.config.model_dump(mode="json"),
            progress=Progress(step=self.step),
        )

    def heartbeat(self, run_id: str) -> Heartbeat:
        self.heartbeats.append(self.status)
        return Heartbeat(run_id=run_id, status=self.status)

    def submit_batch(self, run_id: str, batch: TrainingBatch) -> BatchInfo:
        assert self.queued_polls == 0, "a batch for a queued run (the service's 409)"
        assert batch.step == self.step  # sampled "at" the trained step: never stale
        self.batches.append(batch)
        self.max_lead = max(self.max_lead, len(self.batches) - self.step)
        return BatchInfo(
            id=len(self.batches),
            run_id=run_id,
            rollout_step=batch.step,
            num_samples=len(batch.examples),
            num_tokens=sum(e.num_tokens for e in batch.examples),
            state="pending",
        )

    def get_metrics(self, run_id: str) -> list[StepMetrics]:
        return [
            StepMetrics(step=s, loss=1.0 / s, samples=self.config.batch_size) for s in range(1, self.step + 1)
        ]


def test_sft_loop_batches_tokenizes_and_reports_each_step():
    config = RunConfig(batch_size=2, max_steps=3, loss={"kind": "cross_entropy"})
    client = TrainerClient(config)
    seen = []
    loop = SFTLoop(client, RUN, TOKENIZER, ahead=1, poll_interval_s=0.0, on_step=seen.append)
    examples = [("12+3=", "15"), SFTExample("7+1=", "8", weights=[1.0, 0.5])] + [("1+1=", "2")] * 10
    reports = loop.run(examples)
    assert [r.step for r in reports] == [1, 2, 3] and seen == reports
    assert [r.loss for r in reports] == pytest.approx([1.0, 0.5, 1 / 3])
    assert len(client.batches) == 3  # max_steps batches; the rest is not sent
    assert client.max_lead <= 1
    first = client.batches[0].examples
    assert first[0].prompt_ids == [TOKENIZER.bos_token_id, *TOKENIZER.encode("12+3=")]
    assert first[0].completion_ids == [*TOKENIZER.encode("15"), TOKENIZER.eos_token_id]
    assert first[0].weights is None and first[0].completion_mask == [True, True, True]
    assert first[1].weights == [1.0, 0.5]


def test_sft_loop_refuses_a_run_that_is_not_cross_entropy_and_bad_weights():
    client = TrainerClient(RunConfig(batch_size=2, max_steps=3))
    with pytest.raises(ValueError, match="needs 'cross_entropy'"):
        SFTLoop(client, RUN, TOKENIZER).run([("a", "b")])
    with pytest.raises(ValueError, match="weights has 1 entries"):
        SFTLoop(client, RUN, TOKENIZER).encode(SFTExample("a", "bc", weights=[1.0]))


def test_sft_loop_waits_for_a_queued_run_to_become_active():
    """A run beyond its tenant's quota starts queued; its batches were refused with a 409."""
    client = TrainerClient(
        RunConfig(batch_size=1, max_steps=2, loss={"kind": "cross_entropy"}), queued_polls=3
    )
    reports = SFTLoop(client, RUN, TOKENIZER, poll_interval_s=0.0).run([("1+1=", "2")] * 2)
    assert [r.step for r in reports] == [1, 2] and client.queued_polls == 0


def test_sft_loop_names_why_a_queued_run_waited_too_long():
    client = TrainerClient(
        RunConfig(batch_size=1, max_steps=2, loss={"kind": "cross_entropy"}), queued_polls=10**6
    )
    with pytest.raises(TimeoutError, match="still queued"):
        SFTLoop(client, RUN, TOKENIZER, poll_interval_s=0.0, timeout_s=0.05).run([("1+1=", "2")])
    assert client.batches == []


def test_sft_loop_heartbeats_a_queued_run_while_it_waits_for_a_slot():
    """The service evicts a queued run with a heartbeat_timeout that stays silent that long (measured
    from its creation): waiting for a slot must not look like a dead orchestrator."""
    config = RunConfig(batch_size=1, max_steps=1, loss={"kind": "cross_entropy"}, heartbeat_timeout=60)
    client = TrainerClient(config, queued_polls=3)
    SFTLoop(client, RUN, TOKENIZER, poll_interval_s=0.0, heartbeat_interval_s=1e-9).run([("1+1=", "2")])
    # The first poll only finds it queued; each of the two polls of the wait beats.
    assert client.heartbeats.count("queued") == 2


def test_sft_loop_heartbeats_an_active_run_while_the_trainer_works():
    """Batches are no heartbeat: a long SFT run with a heartbeat_timeout was evicted mid-training."""
    config = RunConfig(batch_size=1, max_steps=3, loss={"kind": "cross_entropy"}, heartbeat_timeout=60)
    client = TrainerClient(config)
    SFTLoop(client, RUN, TOKENIZER, poll_interval_s=0.0, heartbeat_interval_s=1e-9).run([("1+1=", "2")] * 3)
    assert client.heartbeats.count("active") >= 3  # at least one per step waited for


def test_sft_loop_heartbeats_three_times_per_heartbeat_timeout():
    """The default interval (10 s) is longer than a short heartbeat_timeout allows."""
    config = RunConfig(batch_size=1, max_steps=1, loss={"kind": "cross_entropy"}, heartbeat_timeout=0.3)
    loop = SFTLoop(TrainerClient(config), RUN, TOKENIZER)
    run = loop.client.get_run(RUN)
    assert loop._heartbeat_interval(run) == pytest.approx(0.1)
    without_timeout = TrainerClient(RunConfig(batch_size=1, max_steps=1)).get_run(RUN)
    assert loop._heartbeat_interval(without_timeout) == 10.0
