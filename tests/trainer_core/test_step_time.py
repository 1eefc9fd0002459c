"""A step's `step_time_s` runs from its first pack (its data was there, the previous step had ended)
to its end. It ran from the slot's admission, so the first step after a pool (re)start reported the
wait for the run's first batch as training time (and `tokens_per_s` divided by it)."""

import pytest

from contracts.progress import Progress
from contracts.run_config import RunConfig
from trainer_core import slots
from trainer_core.optim import StepStats
from trainer_core.packing import RunPackStats
from trainer_core.slots import RunSlot

STATS = StepStats(grad_norm=0.5, lr=1e-3, loss_tokens=8, nonfinite=False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(slots.time, "monotonic", fake)
    return fake


def pack(step: int, *, completed: bool) -> RunPackStats:
    return RunPackStats(samples=2, tokens=40, loss_tokens=8, step_completed=completed, step=step)


def admitted() -> RunSlot:
    return RunSlot(slot=0, run_id="run_0123456789ab", config=RunConfig(), progress=Progress())


def test_the_first_step_after_admission_excludes_the_wait_for_its_first_batch(clock: Clock) -> None:
    run = admitted()  # the pool (re)started and admitted the run
    clock.now += 300.0  # the orchestrator's first batch comes five minutes later
    run.step_metrics.add_pack(pack(1, completed=True), fill=(64, 64))
    clock.now += 2.0  # the pack's forward, backward and optimizer step
    metrics = run.finish_step(STATS)
    assert metrics.step_time_s == pytest.approx(2.0)  # was 302
    assert metrics.tokens_per_s == pytest.approx(32.0)  # 64 tokens in 2 s, not in 302


def test_a_step_of_several_packs_runs_from_its_first(clock: Clock) -> None:
    run = admitted()
    clock.now += 5.0
    run.step_metrics.add_pack(pack(0, completed=False))
    clock.now += 1.0  # waiting for the rest of the step's samples is part of the step
    run.step_metrics.add_pack(pack(1, completed=True))
    clock.now += 1.5
    assert run.finish_step(STATS).step_time_s == pytest.approx(2.5)


def test_later_steps_run_from_their_first_pack_never_before_the_previous_end(clock: Clock) -> None:
    run = admitted()
    run.step_metrics.add_pack(pack(1, completed=True))
    clock.now += 1.0
    assert run.finish_step(STATS).step_time_s == pytest.approx(1.0)
    # Its data already buffered: the next step's first pack follows the previous step's end at once.
    run.step_metrics.add_pack(pack(2, completed=True))
    clock.now += 1.25
    assert run.finish_step(STATS).step_time_s == pytest.approx(1.25)
    # Its data came a minute after the previous step ended: the minute is no part of it.
    clock.now += 60.0
    run.step_metrics.add_pack(pack(3, completed=True))
    clock.now += 0.75
    assert run.finish_step(STATS).step_time_s == pytest.approx(0.75)


def test_a_manual_step_runs_from_its_first_forward_backward(clock: Clock) -> None:
    """A manual run's step (trainer_core.manual: forward_backward requests, then optim_step) makes no
    packs: it starts at its first forward_backward (`begin`), not at the pool's admission."""
    run = admitted()
    clock.now += 120.0  # the client's first request comes two minutes after the pool started
    run.step_metrics.begin()
    clock.now += 1.0
    run.step_metrics.begin()  # a second forward_backward of the same step
    clock.now += 0.5
    assert run.finish_step(STATS).step_time_s == pytest.approx(1.5)  # was 121.5


def test_a_step_without_packs_runs_from_the_previous_end(clock: Clock) -> None:
    """A step with neither a pack nor a forward_backward (an optim_step alone) is timed from the
    previous step's end."""
    run = admitted()
    clock.now += 3.0
    assert run.finish_step(STATS).step_time_s == pytest.approx(3.0)
    clock.now += 4.0
    assert run.finish_step(STATS).step_time_s == pytest.approx(4.0)
