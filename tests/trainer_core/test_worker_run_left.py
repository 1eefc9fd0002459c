"""A run that leaves between the state sync and its publish is released; the pool trains on (issue 10).

The real PoolTrainer, fed from memory: the service's answer for a run that was deleted, evicted or
whose tenant went away mid-step is simulated at the request where it lands (adapter upload, step
report, restart). The end-to-end race against the real service is tests/e2e/test_lifecycle_races.py.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from contracts.http import ApiError, Conflict, NotFound, ServerError
from contracts.pool_api import AdapterStored, RunAfterPush, StepReport
from contracts.run_config import RunConfig
from tests.e2e.helpers import assert_trained_alike, run_config, synthetic_batch
from tests.trainer_core.memory_pool import train_in_memory
from trainer_core.memory_client import MemoryPoolClient
from trainer_core.run_left import run_has_left

VICTIM, OTHER = "run_000000000000", "run_000000000001"


class LeavingClient(MemoryPoolClient):
    """The victim leaves the service when the pool's `at` request about it arrives: that request gets
    `answer` and the state no longer lists it."""

    def __init__(self, payloads, config, *, at: str, answer: ApiError) -> None:
        super().__init__(payloads, config)
        self.at, self.answer = at, answer
        self.left = False
        self.calls: list[tuple[str, str]] = []

    def _maybe_leave(self, what: str, run_id: str) -> None:
        self.calls.append((what, run_id))
        if run_id == VICTIM and (self.left or what == self.at):
            self.left = True
            self.evictions[VICTIM] = "left"  # no longer listed by state()
            raise self.answer

    def restart_run(self, run_id, **kwargs):
        self._maybe_leave("restart", run_id)
        return super().restart_run(run_id, **kwargs)

    def upload_adapter(self, run_id: str, step: int, adapter_dir: Path) -> AdapterStored:
        self._maybe_leave("upload", run_id)
        return super().upload_adapter(run_id, step, adapter_dir)

    def report_step(self, run_id: str, report: StepReport) -> RunAfterPush:
        self._maybe_leave("report", run_id)
        return super().report_step(run_id, report)


def _config() -> dict:
    return RunConfig.model_validate(run_config(max_steps=3, seed=5)).model_dump(mode="json")


GOOD = [synthetic_batch(s, n_samples=4) for s in (1, 2, 3)]
VICTIM_BATCHES = [synthetic_batch(s, n_samples=4) for s in (11, 12, 13)]


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict[str, torch.Tensor]:
    client = MemoryPoolClient([GOOD], _config())
    train_in_memory(client, tmp_path_factory.mktemp("alone"))
    return load_safetensors(client.adapters[VICTIM])  # the only run is run 0


@pytest.mark.parametrize(
    ("at", "answer"),
    [
        ("upload", Conflict("run is deleted; it has no adapters", status=409, code="run_not_trainable")),
        (
            "report",
            Conflict(
                "run is evicted; steps are recorded for active runs only", status=409, code="run_not_active"
            ),
        ),
        ("upload", NotFound("run not found", status=404, code="not_found")),
        ("restart", Conflict("run is deleted; only active runs restart", status=409, code="run_not_active")),
    ],
    ids=["deleted-at-upload", "evicted-at-report", "tenant-gone-404", "deleted-before-restart"],
)
def test_a_run_leaving_mid_step_is_released_and_the_other_trains_on(tmp_path, alone, at, answer) -> None:
    client = LeavingClient([VICTIM_BATCHES, GOOD], _config(), at=at, answer=answer)
    trainer = train_in_memory(client, tmp_path)

    assert client.left
    assert trainer.slots == {}  # both released: the victim when it left, the other when complete
    assert trainer.master is not None and trainer.master.packer.active_slots() == []
    assert VICTIM not in client.adapters or at == "report"  # nothing published after it left
    # After the answer, the pool asks nothing more about the victim.
    first = client.calls.index((at, VICTIM))
    assert [c for c in client.calls[first + 1 :] if c[1] == VICTIM] == []
    assert client.runs[OTHER].step == 3
    assert_trained_alike(load_safetensors(client.adapters[OTHER]), alone)


def test_an_error_that_is_not_about_the_run_still_stops_the_pool(tmp_path) -> None:
    client = LeavingClient(
        [VICTIM_BATCHES, GOOD], _config(), at="upload", answer=ServerError("boom", status=500)
    )
    with pytest.raises(ServerError):
        train_in_memory(client, tmp_path)


@pytest.mark.parametrize(
    ("exc", "left"),
    [
        (Conflict("x", status=409, code="run_not_active"), True),
        (Conflict("x", status=409, code="run_not_trainable"), True),
        (Conflict("x", status=409, code="ack_rejected"), True),
        (NotFound("x", status=404, code="not_found"), True),
        (NotFound("x", status=404, code="pool_not_found"), False),
        (Conflict("x", status=409, code="pool_dead"), False),
        (Conflict("x", status=409, code="idempotency_conflict"), False),
        (ServerError("x", status=503), False),
        (ApiError("no answer"), False),
        (ValueError("x"), False),
    ],
)
def test_which_answers_mean_the_run_has_left(exc, left) -> None:
    assert run_has_left(exc) is left
