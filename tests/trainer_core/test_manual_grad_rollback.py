"""A forward_backward that fails leaves its run's gradients exactly as they were before it.

A request bigger than one packed row runs as several rows, each with its own backward into the
run's LoRA `.grad`: one failing in its second row had its first row's gradient in, which the run's
next optim_step applied, and which a client's retry of the request counted twice. A row whose
backward failed half-way left part of its gradient the same way. Here the real ManualExecutor on
the tiny model (tests/trainer_core/manual_ranks.py), the failure injected in the loss or the
backward of a chosen datum, and the gradients compared bit for bit with those before the request,
and after a retry with those of a pool that ran the request once, cleanly; on one rank and on two
gloo ranks, where the request's rows run on both and the failure on one only."""

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.tinker_work import ManualDatum, ManualWorkItem
from tests.trainer_core.manual_ranks import (
    LONG,
    RaisingBackward,
    RankPool,
    failing,
    forward_backward,
    on_two_ranks,
    same,
)
from trainer_core import manual
from trainer_core.dist import World
from trainer_core.grad_rollback import GradSnapshots


def _fail_second_row(in_backward: bool) -> AbstractContextManager[None]:
    return failing("big", 1, RuntimeError("injected: the second row fails"), in_backward=in_backward)


@pytest.mark.parametrize("in_backward", [False, True], ids=["in-its-loss", "in-its-backward"])
def test_a_request_failing_in_its_second_row_leaves_the_gradients_as_before_and_a_retry_counts_once(
    tmp_path: Path, in_backward: bool
) -> None:
    # Three long datums: three rows of their own. A gradient is there already (an earlier request of
    # the step), so the rollback must give back those values, not zeros.
    earlier = forward_backward("earlier", "run_0", 1, 5, 7)
    big = forward_backward("big", "run_0", 2, LONG, LONG, LONG)

    reference = RankPool(tmp_path / "reference")
    reference.serve([earlier])
    clean = reference.serve([big])
    assert clean["big"]["error"] is None

    pool = RankPool(tmp_path / "pool")
    pool.serve([earlier])
    before = pool.grads(0)
    with _fail_second_row(in_backward):
        failed = pool.serve([big])
    error = failed["big"]["error"]
    assert error is not None and "injected: the second row fails" in error
    assert same(pool.grads(0), before), "the failed request left part of its gradient"
    assert pool.slots[0].step_metrics.samples == 2  # the earlier request's only

    retried = pool.serve([big.model_copy(update={"seq_id": 3})])
    assert retried["big"]["error"] is None
    assert retried["big"]["logprobs"] == clean["big"]["logprobs"]
    assert same(pool.grads(0), reference.grads(0)), "a retry must count the request once"
    assert pool.slots[0].step_metrics.samples == reference.slots[0].step_metrics.samples == 5


def test_the_run_s_other_requests_of_the_round_keep_their_gradients(tmp_path: Path) -> None:
    """Rolling the run back takes out its other forward_backwards of the round too: they run again,
    alone, and succeed with the gradients they would have had without the failed one. Another
    run's request is not touched at all."""
    first = forward_backward("first", "run_0", 1, 9)
    big = forward_backward("big", "run_0", 2, LONG, LONG, LONG)
    last = forward_backward("last", "run_0", 3, LONG)
    other = forward_backward("other", "run_1", 1, LONG, LONG)

    reference = RankPool(tmp_path / "reference")
    expected = reference.serve([first, last, other])

    pool = RankPool(tmp_path / "pool")
    with _fail_second_row(in_backward=False):
        results = pool.serve([first, big, last, other])

    assert results["big"]["error"] is not None
    for request_id in ("first", "last", "other"):
        assert results[request_id]["error"] is None
        assert results[request_id]["logprobs"] == expected[request_id]["logprobs"]
    for got, want in zip(pool.grads(0), reference.grads(0), strict=True):
        torch.testing.assert_close(got, want)  # run again in other rows: the same up to rounding
    assert same(pool.grads(1), reference.grads(1))
    assert pool.slots[0].step_metrics.samples == 2 and pool.slots[1].step_metrics.samples == 2


def test_a_request_that_fits_one_row_and_fails_before_its_backward_rolls_nothing_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing of it was accumulated: its run's other requests are not run again (the cheap path)."""
    pool = RankPool(tmp_path)
    pool.serve([forward_backward("earlier", "run_0", 1, 5)])
    before = pool.grads(0)
    restored: list[int] = []
    real = GradSnapshots.restore

    def restore(self: GradSnapshots, slot: int) -> None:
        restored.append(slot)
        real(self, slot)

    monkeypatch.setattr(GradSnapshots, "restore", restore)
    with failing("small", 0, RuntimeError("injected")):
        results = pool.serve(
            [forward_backward("small", "run_0", 2, 6), forward_backward("ok", "run_0", 3, 4)]
        )
    assert results["small"]["error"] is not None and results["ok"]["error"] is None
    assert restored == []
    assert not same(pool.grads(0), before)  # "ok" added its gradient, once


# -- two ranks ---------------------------------------------------------------------------------


def _two_rank_rollback(world: World, tmp_path: Path, out_dir: Path) -> dict[str, Any]:
    """Rows 0 and 2 of "big" run on rank 0, row 1 on rank 1, where it fails: rank 0 must roll back
    too, though nothing failed there. "earlier" (two rows) leaves a gradient on both ranks first."""
    earlier = forward_backward("earlier", "run_0", 1, LONG, LONG)
    big = forward_backward("big", "run_0", 2, LONG, LONG, LONG)

    reference = RankPool(tmp_path / "reference", world)
    reference.serve([earlier])
    clean = reference.serve([big])

    pool = RankPool(tmp_path / "pool", world)
    pool.serve([earlier])
    before = pool.grads(0)
    with failing("big", 1, RuntimeError("injected on rank 1")):
        failed = pool.serve([big])
    rolled_back = same(pool.grads(0), before)
    retried = pool.serve([big.model_copy(update={"seq_id": 3})])
    return {
        "had_gradient": any(bool(g.abs().sum() > 0) for g in before),
        "rolled_back": rolled_back,
        "retry_counts_once": same(pool.grads(0), reference.grads(0)),
        "clean_error": clean.get("big", {}).get("error"),
        "failed_error": failed.get("big", {}).get("error"),
        "retried_error": retried.get("big", {}).get("error"),
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_on_two_ranks_a_request_failed_on_one_is_rolled_back_on_both(tmp_path: Path) -> None:
    master, other = on_two_ranks(_two_rank_rollback, tmp_path)
    for rank in (master, other):
        assert rank["had_gradient"]
        assert rank["rolled_back"], rank
        assert rank["retry_counts_once"], rank
    assert master["clean_error"] is None and master["retried_error"] is None
    assert "injected on rank 1" in master["failed_error"]


def test_a_request_failing_when_run_again_is_rolled_back_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request "last" passes in the shared pass; its backward fails when run again after "big" failed:
    the run is rolled back once more and only "first" is added back."""
    first = forward_backward("first", "run_0", 1, 9)
    big = forward_backward("big", "run_0", 2, LONG, LONG, LONG)
    last = forward_backward("last", "run_0", 3, LONG)

    reference = RankPool(tmp_path / "reference")
    reference.serve([first])

    pool = RankPool(tmp_path / "pool")
    real = manual._loss
    runs_of_last = 0

    def loss(item: ManualWorkItem, datum: ManualDatum, lp: torch.Tensor) -> torch.Tensor:
        nonlocal runs_of_last
        if item.request_id == "last":
            runs_of_last += 1
            if runs_of_last == 2:  # its run again, after "big" failed: its backward fails
                failing_backward: torch.Tensor = RaisingBackward.apply(
                    real(item, datum, lp), RuntimeError("injected: fails when run again")
                )
                return failing_backward
        return real(item, datum, lp)

    monkeypatch.setattr(manual, "_loss", loss)
    with failing("big", 1, RuntimeError("injected: the second row fails")):
        results = pool.serve([first, big, last])

    assert runs_of_last == 2
    assert results["first"]["error"] is None
    assert "the second row fails" in results["big"]["error"]
    assert "fails when run again" in results["last"]["error"]
    for got, want in zip(pool.grads(0), reference.grads(0), strict=True):
        torch.testing.assert_close(got, want)
    assert pool.slots[0].step_metrics.samples == 1
