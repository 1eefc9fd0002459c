"""Device errors stop the pool; a load_weights has one outcome on every rank.

The pool catches what one Tinker request raises so that it fails alone. A CUDA error such as an
illegal memory access leaves the device's state undefined: caught, the pool went on training every
tenant on it. Such errors now go through (trainer_core.device_errors), wherever a request's work
runs: its pass, its backward, its sampling, its load. Out of memory stays a request's own failure.

A load_weights runs on every rank; one that failed on one rank only (a file it could not read)
left the ranks with different weights, and one that failed half-way (the optimizer state, after
the adapter) left a mix on every rank. Now every rank ends with the loaded state, or every rank
with the state before the request. Errors are simulated on CPU by raising them (the torch type, or
the RuntimeError text older builds raise) where the request's work runs."""

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.tinker_work import ManualWorkItem
from tests.trainer_core.manual_ranks import (
    LONG,
    RankPool,
    failing,
    forward_backward,
    on_two_ranks,
    optim_step,
    same,
    same_state,
)
from tests.trainer_core.test_manual_isolation import _sample
from trainer_core import device_errors, manual, sampling
from trainer_core.checkpoint import CheckpointData
from trainer_core.device_errors import is_fatal_device_error
from trainer_core.dist import World
from trainer_core.lora import MultiLoRA

FATAL = [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`"),
]
FATAL_IDS = ["accelerator-error", "device-side-assert", "cublas"]


def test_which_errors_are_fatal() -> None:
    for error in FATAL:
        assert is_fatal_device_error(error)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_fatal_device_error(oom)
    assert not is_fatal_device_error(torch.AcceleratorError("CUDA error: out of memory"))
    assert not is_fatal_device_error(RuntimeError("probability tensor contains either `inf`, `nan`"))
    assert not is_fatal_device_error(OSError("No space left on device"))
    try:
        try:
            raise FATAL[0]
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert is_fatal_device_error(outer)  # a cause counts (a backward failure is re-raised wrapped)


@pytest.mark.parametrize("in_backward", [False, True], ids=["in-the-pass", "in-the-backward"])
@pytest.mark.parametrize("error", FATAL, ids=FATAL_IDS)
def test_a_device_error_in_a_forward_backward_stops_the_pool(
    tmp_path: Path, error: BaseException, in_backward: bool
) -> None:
    pool = RankPool(tmp_path)
    with failing("bad", 0, error, in_backward=in_backward), pytest.raises(type(error)) as raised:
        pool.serve([forward_backward("good", "run_0", 1, 5), forward_backward("bad", "run_1", 1, 5)])
    assert str(raised.value) == str(error)


def test_out_of_memory_fails_the_request_alone_and_the_pool_goes_on(tmp_path: Path) -> None:
    """Recoverable: the allocator raises before the kernel runs, the context is intact."""
    pool = RankPool(tmp_path)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with failing("bad", 1, oom):
        results = pool.serve(
            [forward_backward("good", "run_0", 1, 5), forward_backward("bad", "run_1", 1, LONG, LONG)]
        )
    assert results["bad"]["error"].startswith(
        "the pool could not run this forward_backward: OutOfMemoryError"
    )
    assert results["good"]["error"] is None
    assert all(torch.all(g == 0) for g in pool.grads(1))  # its first row's gradient rolled back
    after = pool.serve([forward_backward("next", "run_1", 2, 5)])
    assert after["next"]["error"] is None


@pytest.mark.parametrize("error", FATAL, ids=FATAL_IDS)
def test_a_device_error_while_sampling_stops_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    def pick_token(*args: Any) -> int:
        raise error

    monkeypatch.setattr(sampling, "pick_token", pick_token)
    pool = RankPool(tmp_path)
    with pytest.raises(type(error)):
        pool.serve([_sample("s", 1.0, seed=1, run_id="run_0", step=1)])


def _save(request_id: str, seq_id: int) -> ManualWorkItem:
    return ManualWorkItem(request_id=request_id, run_id="run_0", seq_id=seq_id, kind="save_weights", name="s")


def _load(request_id: str, seq_id: int) -> ManualWorkItem:
    return ManualWorkItem(
        request_id=request_id,
        run_id="run_0",
        seq_id=seq_id,
        kind="load_weights",
        name="s",
        source_run_id="run_0",
        with_optimizer=True,
    )


def _saved_then_trained(pool: RankPool) -> list[torch.Tensor]:
    """A step, a state saved as "s" (returns its adapter), another step, and a gradient pending: the
    run's adapter, Adam moments, step and gradients all differ from the saved ones."""
    pool.serve([forward_backward("fb1", "run_0", 1, 5), optim_step("step1", "run_0", 2)])
    saved = pool.serve([_save("save", 3)])  # the master writes; every rank takes part in the round
    assert not saved or saved["save"]["error"] is None
    adapter = pool.params(0)
    pool.serve([forward_backward("fb2", "run_0", 4, 6), optim_step("step2", "run_0", 5)])
    pool.serve([forward_backward("fb3", "run_0", 6, 7)])
    return adapter


def _state(pool: RankPool) -> dict[str, Any]:
    return {
        "params": pool.params(0),
        "grads": pool.grads(0),
        "optimizer": copy.deepcopy(pool.optimizer.state_dict(0)),
        "step": pool.slots[0].progress.step,
    }


def test_a_device_error_while_loading_weights_stops_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = RankPool(tmp_path)
    _saved_then_trained(pool)

    def broken(self: MultiLoRA, slot: int, state: dict[str, torch.Tensor]) -> None:
        raise FATAL[0]

    monkeypatch.setattr(MultiLoRA, "load_slot_state_dict", broken)
    with pytest.raises(torch.AcceleratorError):
        pool.serve([_load("load", 7)])


def _bad_optimizer_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The saved state's optimizer part does not fit: it fails after the adapter was loaded."""
    real = manual.load_checkpoint

    def load_checkpoint(path: Path) -> CheckpointData:
        ckpt = real(path)
        state = dict(ckpt.optimizer_state, optimizer={"state": {}, "param_groups": []})
        return dataclasses.replace(ckpt, optimizer_state=state)

    monkeypatch.setattr(manual, "load_checkpoint", load_checkpoint)


def test_a_load_that_fails_half_way_leaves_the_run_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = RankPool(tmp_path)
    saved = _saved_then_trained(pool)
    before = _state(pool)
    assert before["step"] == 3 and any(bool(g.abs().sum() > 0) for g in before["grads"])

    _bad_optimizer_state(monkeypatch)
    results = pool.serve([_load("load", 7)])
    assert results["load"]["error"].startswith("the pool could not run this load_weights: ValueError")
    assert same(pool.params(0), before["params"]), "the adapter was loaded though the request failed"
    assert same_state(_state(pool), before)

    monkeypatch.undo()
    assert pool.serve([_load("again", 8)])["again"]["error"] is None
    assert same(pool.params(0), saved) and pool.slots[0].progress.step == 2


def test_a_load_whose_snapshot_runs_out_of_memory_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy of the run taken before a load can run out of memory too: the request fails, nothing
    was loaded, and the pool goes on."""
    pool = RankPool(tmp_path)
    saved = _saved_then_trained(pool)
    before = _state(pool)

    def no_memory(*args: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(manual.SlotSnapshot, "take", no_memory)
    results = pool.serve([_load("load", 7)])
    assert "OutOfMemoryError" in results["load"]["error"]
    assert same_state(_state(pool), before)
    monkeypatch.undo()
    assert pool.serve([_load("again", 8)])["again"]["error"] is None
    assert same(pool.params(0), saved)


def test_on_a_torch_without_accelerator_error_plain_errors_are_not_fatal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch < 2.8 (which the project allows) has no `torch.AcceleratorError`: telling errors apart
    must not raise there (it would stop the pool on every failed request)."""
    monkeypatch.delattr(torch, "AcceleratorError")
    monkeypatch.setattr(device_errors, "_ACCELERATOR_ERROR", None)
    assert not is_fatal_device_error(RuntimeError("the saved weights do not fit"))
    assert is_fatal_device_error(RuntimeError("CUDA error: device-side assert triggered"))


# -- two ranks ---------------------------------------------------------------------------------


def _two_rank_load(world: World, tmp_path: Path, out_dir: Path) -> dict[str, Any]:
    """Rank 1 cannot read the saved state; rank 0 can. Then both can."""
    pool = RankPool(tmp_path / "pool", world)
    saved = _saved_then_trained(pool)
    before = _state(pool)
    real = manual.load_checkpoint
    if world.rank == 1:

        def unreadable(path: Path) -> CheckpointData:
            raise OSError(5, "Input/output error", str(path))

        manual.load_checkpoint = unreadable
    try:
        failed = pool.serve([_load("load", 7)])
    finally:
        manual.load_checkpoint = real
    kept = same_state(_state(pool), before)
    loaded = pool.serve([_load("again", 8)])
    return {
        "kept_before_on_failure": kept,
        "loaded_on_success": same(pool.params(0), saved),
        "failed_error": failed.get("load", {}).get("error"),
        "loaded_error": loaded.get("again", {}).get("error"),
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_on_two_ranks_a_load_failing_on_one_fails_on_both(tmp_path: Path) -> None:
    master, other = on_two_ranks(_two_rank_load, tmp_path)
    for rank in (master, other):
        assert rank["kept_before_on_failure"], rank
        assert rank["loaded_on_success"], rank
    assert master["failed_error"].startswith("rank 1 of the pool: "), master["failed_error"]
    assert "Input/output error" in master["failed_error"]
    assert master["loaded_error"] is None
