"""A stop request ends the pool under a steady Tinker load. `run()` went back to the top of its loop
after every round that ran manual work, past the one place that checks the stop (the plan), so while
each round found work, Ctrl-C / SIGTERM never stopped the pool. Now the plan follows every round and
a stopping master claims nothing more: the round in progress finishes and is reported, and the plan's
broadcast after it stops every rank at that same point (after one more round, without work).

The real PoolTrainer fed from memory, one manual run, a request in every claim; the stop is set as the
signal handler sets it, from inside a chosen round (no sleeps, no threads). A pool that kept claiming
fails the test instead of hanging it."""

from pathlib import Path

import pytest
import torch

from contracts.pool_api import PoolRunState
from contracts.run_config import RunConfig
from contracts.tinker_work import ManualDatum, ManualResult, ManualWorkItem
from tests.e2e.helpers import run_config, synthetic_batch
from tests.trainer_core.manual_ranks import on_two_ranks
from tests.trainer_core.memory_pool import memory_pool_args
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.worker import PoolTrainer, WorkerArgs

RUN = "run_000000000000"
OVERRUN = 5
"""Claims past the stop that make the test fail (the loop never stopped) instead of hang."""


class SteadyTinkerLoad(MemoryPoolClient):
    """One manual run whose every claim holds a `forward` request; `stop_in_round` asks the trainer
    to stop while that round is being claimed (as a signal arriving during the round would)."""

    def __init__(self, stop_in_round: int) -> None:
        config = RunConfig.model_validate(run_config(mode="manual", max_steps=100)).model_dump(mode="json")
        super().__init__([[]], config)  # one run, no rollout batches
        self.stop_in_round = stop_in_round
        self.trainer: PoolTrainer | None = None
        self.claims = 0
        self.answered: list[str] = []

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]:
        self.claims += 1
        assert self.claims <= self.stop_in_round + OVERRUN, "still claiming Tinker work after the stop"
        if self.claims == self.stop_in_round:
            assert self.trainer is not None
            self.trainer.stop_requested = True
        tokens = [5, 6, 7, 8, 9]
        datum = ManualDatum(tokens=tokens, target_tokens=tokens[1:] + [10], weights=[1.0] * 5)
        return [
            ManualWorkItem(
                request_id=f"req_{self.claims}",
                run_id=RUN,
                seq_id=self.claims,
                kind="forward",
                loss_fn="cross_entropy",
                data=[datum],
            )
        ]

    def report_manual(self, results: list[ManualResult]) -> None:
        for result in results:
            assert result.error is None and not result.release, result
            self.answered.append(result.request_id)


def _args(tmp_path: Path) -> WorkerArgs:
    return memory_pool_args(tmp_path, exit_when_idle_s=None)  # only the stop ends these loops


def _run_until_stopped(client: SteadyTinkerLoad, tmp_path: Path) -> PoolTrainer:
    """A one-rank pool fed by `client`, which sets its stop."""
    trainer = PoolTrainer(
        _args(tmp_path), world=World(), device=torch.device("cpu"), source=HttpRunSource(client)
    )
    client.trainer = trainer
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer


@pytest.mark.parametrize("stop_in_round", [1, 3])
def test_a_stop_during_a_tinker_round_ends_the_loop_after_it(tmp_path: Path, stop_in_round: int) -> None:
    client = SteadyTinkerLoad(stop_in_round)
    trainer = _run_until_stopped(client, tmp_path)
    # The round the stop arrived in ran and was answered; nothing was claimed after it.
    assert client.claims == stop_in_round
    assert client.answered == [f"req_{n}" for n in range(1, stop_in_round + 1)]
    assert [run.run_id for run in trainer.slots.values()] == [RUN]  # it served the run, not idled


STOP_IN_ROUND = 3


def _stop_on_two_ranks(world: World, tmp_path: Path, _out: Path) -> dict[str, object]:
    """Rank 0 is asked to stop in round STOP_IN_ROUND; rank 1 from the start (signals reach ranks
    at different times): the master's word alone decides, so both leave after the same round."""
    client = SteadyTinkerLoad(STOP_IN_ROUND) if world.is_master else None
    trainer = PoolTrainer(
        _args(tmp_path / f"rank{world.rank}"),
        world=world,
        device=torch.device("cpu"),
        source=HttpRunSource(client) if client else None,
    )
    if client is not None:
        client.trainer = trainer
    else:
        trainer.stop_requested = True
    assert trainer.manual is not None
    serve, rounds = trainer.manual.serve, []

    def counted(**kwargs: object) -> bool:
        ran = serve(**kwargs)  # type: ignore[arg-type]
        rounds.append(ran)
        return ran

    trainer.manual.serve = counted  # type: ignore[method-assign]
    try:
        trainer.run()
    finally:
        trainer.close()
    return {
        "rounds with work": sum(rounds),
        "rounds": len(rounds),
        "claims": client.claims if client else None,
        "answered": client.answered if client else None,
    }


def test_every_rank_stops_after_the_same_round(tmp_path: Path) -> None:
    master, other = on_two_ranks(_stop_on_two_ranks, tmp_path)
    assert master["claims"] == STOP_IN_ROUND
    assert master["answered"] == [f"req_{n}" for n in range(1, STOP_IN_ROUND + 1)]
    # Each rank ran the same rounds: the work of each, then the plan's stop and one round without
    # work (which drops a lost pool's Tinker state on every rank).
    assert master["rounds with work"] == other["rounds with work"] == STOP_IN_ROUND
    assert master["rounds"] == other["rounds"] == STOP_IN_ROUND + 1


ROLLOUT = "run_000000000001"
STARVED = 200
"""Tinker rounds after which the rollout run counts as starved (it needs a handful)."""


class TinkerLoadBesideARolloutRun(SteadyTinkerLoad):
    """The manual run's steady load (a request in every claim), and beside it a rollout run of
    another tenant with two steps' batches waiting; the pool is asked to stop once that run has
    trained both."""

    def __init__(self) -> None:
        super().__init__(stop_in_round=STARVED + 1)  # the stop is this class's own (claim_manual)
        rollout = RunConfig.model_validate(run_config(max_steps=2, seed=5)).model_dump(mode="json")
        self.manual_config, self.config = self.config, rollout
        batches = [synthetic_batch(s, n_samples=4, rollout_step=s) for s in range(2)]
        MemoryPoolClient.__init__(self, [batches, batches], rollout)
        self.pending = [c for c in self.pending if c.run_id == ROLLOUT]  # the manual run takes none

    def state(self) -> list[PoolRunState]:
        return [
            s.model_copy(update={"config": self.manual_config}) if s.run_id == RUN else s
            for s in super().state()
        ]

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]:
        assert self.trainer is not None
        if self.runs[ROLLOUT].step >= 2:
            self.trainer.stop_requested = True
        assert self.claims < STARVED, "the rollout run never trained while Tinker work kept coming"
        return super().claim_manual(max_items)


def test_a_steady_tinker_load_does_not_starve_another_tenants_rollout_run(tmp_path: Path) -> None:
    client = TinkerLoadBesideARolloutRun()
    _run_until_stopped(client, tmp_path)
    assert client.runs[ROLLOUT].step == 2 and ROLLOUT not in client.evictions
    assert len(client.answered) == client.claims  # every Tinker round was served meanwhile
