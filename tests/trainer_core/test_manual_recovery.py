"""The pool's side of Tinker work after a crash, without processes: which re-delivered requests a
restored checkpoint already holds (trainer_core.manual._in_checkpoint), the boundary a manual
checkpoint carries (publish.restore_manual_boundary), and the merge of several ranks' outputs."""

from pathlib import Path

import torch

from contracts.progress import Progress
from contracts.run_config import RunConfig
from contracts.tinker_work import AdamStep, ManualDatum, ManualWorkItem
from trainer_core.checkpoint import save_checkpoint
from trainer_core.manual import _in_checkpoint, _merged, _Outputs
from trainer_core.publish import MANUAL_BOUNDARY, checkpoint_root, restore_manual_boundary
from trainer_core.slots import ManualBoundary, RunSlot

ADAM = AdamStep(learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
DATUM = ManualDatum(tokens=[1, 2], target_tokens=[2, 3], weights=[1.0, 1.0])


def _item(seq_id: int, kind: str, *, replay: bool = False) -> ManualWorkItem:
    extra = {"adam": ADAM} if kind == "optim_step" else {"data": [DATUM], "loss_fn": "cross_entropy"}
    return ManualWorkItem.model_validate(
        {"request_id": f"req_{seq_id}", "run_id": "run_a", "seq_id": seq_id, "kind": kind, "replay": replay}
        | extra
    )


def _run(boundary: ManualBoundary | None) -> RunSlot:
    run = RunSlot(0, "run_a", RunConfig(mode="manual"), Progress(step=2))
    run.manual_boundary = boundary
    return run


def test_requests_up_to_the_checkpointed_optim_step_are_answered_not_run_again():
    run = _run(ManualBoundary(seq_id=5, metrics={"grad_norm": 1.5, "step": 2.0}))
    # The dead pool's replayed forward_backwards: already in the checkpoint's weights.
    replayed = _in_checkpoint(_item(3, "forward_backward", replay=True), run)
    assert replayed is not None and replayed.replayed and replayed.error is None
    # Its optim_step, applied and checkpointed but not reported: answered from the checkpoint.
    step = _in_checkpoint(_item(5, "optim_step"), run)
    assert step is not None and step.metrics == {"grad_norm": 1.5, "step": 2.0} and not step.replayed
    # Requests after the boundary run as usual.
    assert _in_checkpoint(_item(6, "forward_backward", replay=True), run) is None
    assert _in_checkpoint(_item(7, "optim_step"), run) is None
    # Without a checkpointed step, everything runs.
    assert _in_checkpoint(_item(3, "forward_backward", replay=True), _run(None)) is None
    # A request of an already checkpointed step coming back unreported breaks the reporting order.
    broken = _in_checkpoint(_item(4, "forward_backward"), run)
    assert broken is not None and broken.error is not None


def test_a_manual_checkpoint_carries_its_boundary(tmp_path: Path):
    assert restore_manual_boundary(tmp_path, "run_a") is None
    adapter = {"w": torch.zeros(2)}
    saved = ManualBoundary(seq_id=9, metrics={"grad_norm": 0.25, "lr": 0.01, "step": 3.0})
    save_checkpoint(
        checkpoint_root(tmp_path, "run_a"),
        3,
        adapter=adapter,
        optimizer_state={},
        progress={"step": 3, "total_tokens": 0, "total_samples": 0},
        extra={MANUAL_BOUNDARY: {"seq_id": saved.seq_id, "metrics": saved.metrics}},
        keep_last=2,
    )
    assert restore_manual_boundary(tmp_path, "run_a") == saved


def test_the_outputs_of_several_ranks_merge_into_one_per_request():
    rank0 = {0: _Outputs(logprobs=[[-1.0], []], losses=[[1.0], []], loss_sum=1.0, weighted_tokens=1)}
    rank1 = {
        0: _Outputs(logprobs=[[], [-2.0, -3.0]], losses=[[], [2.0, 3.0]], loss_sum=5.0, weighted_tokens=2)
    }
    merged = _merged([rank0, rank1])[0]
    assert merged.logprobs == [[-1.0], [-2.0, -3.0]] and merged.losses == [[1.0], [2.0, 3.0]]
    assert (merged.loss_sum, merged.weighted_tokens) == (6.0, 3)
