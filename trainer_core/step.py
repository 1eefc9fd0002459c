"""One training step of the pool, on one rank: the function production and the isolation tests share.

    for each of this rank's micro-batches:   forward, per-run loss SUMS, backward (a run whose
                                             gradients overflow is re-run alone, see `backward_isolated`)
    all-reduce over ranks:                   the loss statistics (`LossStats.to_tensor`) and the LoRA
                                             gradients of every active slot (sums)
    per run whose step completes:            gradient / the run's loss tokens, clip, AdamW, schedule
                                             (`MultiRunOptimizer`); a non-finite run is not stepped

A run's step may span several calls (several packs): its gradients keep accumulating until the pack
that completes it (DESIGN §4.2). Nothing here depends on which other runs share the micro-batches,
which is what the isolation tests check (DESIGN §4.1).
"""

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from contracts.run_config import LossSettings
from trainer_core.dist import World, all_reduce_grads_, all_reduce_sum_
from trainer_core.lora import MultiLoRA
from trainer_core.loss import LossStats, rl_loss
from trainer_core.modeling import forward_packed
from trainer_core.optim import MultiRunOptimizer, StepStats
from trainer_core.packing import MicroBatch


@dataclass
class StepResult:
    """What one call of `train_step` did, the same on every rank."""

    stats: LossStats
    """Per-slot loss statistics of this call, summed over the micro-batches of every rank."""
    stepped: dict[int, StepStats]
    """The runs whose optimizer stepped (their step completed and was finite)."""
    nonfinite: set[int]
    """Runs whose loss or gradients were not finite: not stepped; the caller evicts them."""


def train_step(
    *,
    model: nn.Module,
    lora: MultiLoRA,
    optimizer: MultiRunOptimizer,
    micro_batches: Sequence[MicroBatch],
    loss_settings: Mapping[int, LossSettings],
    completing: Collection[int],
    world: World,
    device: torch.device,
) -> StepResult:
    """Forward/backward this rank's `micro_batches`, all-reduce, and step the runs in `completing`.

    `loss_settings`: every active slot's loss settings (the slots whose gradients are reduced).
    `completing`: the slots whose step the packer completed with these micro-batches (the same on
    every rank). Filler micro-batches only keep ranks in step: they run no pass.
    """
    n_slots = lora.n_slots
    stats = LossStats.zeros(n_slots, device=device)
    for mb in micro_batches:
        if not mb.is_filler:
            stats = stats + backward_isolated(model, lora, _to_device(mb, device), loss_settings)
    active = sorted(loss_settings)
    packed = stats.to_tensor()
    all_reduce_sum_(packed, world)
    stats = LossStats.from_tensor(packed)
    all_reduce_grads_([p for slot in active for p in lora.slot_parameters(slot)], world)

    for slot in active:
        optimizer.add_loss_tokens(slot, stats.loss_tokens[slot])
    nonfinite = {slot for slot in active if bool(stats.nonfinite[slot])}
    stepped = optimizer.step([slot for slot in sorted(completing) if slot not in nonfinite])
    nonfinite |= {slot for slot, s in stepped.items() if s.nonfinite}
    if not world.is_master:
        # The all-reduce left every rank with the sum so far. The master keeps accumulating on it;
        # the others start their partial steps again from zero, so the next all-reduce adds only
        # their new contributions.
        for slot in active:
            if slot not in stepped:
                for p in lora.slot_parameters(slot):
                    p.grad = None
    return StepResult(
        stats=stats,
        stepped={slot: s for slot, s in stepped.items() if not s.nonfinite},
        nonfinite=nonfinite,
    )


def backward_isolated(
    model: nn.Module, lora: MultiLoRA, mb: MicroBatch, loss_settings: Mapping[int, LossSettings]
) -> LossStats:
    """Forward/backward one micro-batch; a run whose gradients blow up cannot poison the others.

    The loss already drops a run whose loss is non-finite. But a finite loss can still overflow in
    the backward pass, and the shared base-model backward then spreads Inf/NaN to every run in the
    row (masked attention gives 0 × Inf). So: keep the gradients from before this micro-batch; if
    any present run's gradients come out non-finite, go back to them and redo the row once per run,
    keeping each run's result only if it is finite. The failing run is reported non-finite (and
    evicted by the caller); the others get exactly their own gradients. Costs one clone of the
    present runs' LoRA gradients per micro-batch, and extra passes only on failure.
    """
    present = [
        slot for slot, n in enumerate(mb.slot_token_counts.tolist()) if n > 0 and slot in loss_settings
    ]
    params = [p for slot in present for p in lora.slot_parameters(slot)]
    before = _clone_grads(params)
    stats = _backward(model, lora, mb, loss_settings)
    if _grads_finite(params):
        return stats
    _restore_grads(params, before)
    merged = LossStats.zeros(lora.n_slots, device=stats.loss_sum.device)
    for slot in present:
        alone = dataclasses.replace(mb, loss_mask=mb.loss_mask & (mb.token_slots == slot))
        kept = _clone_grads(params)
        own = _backward(model, lora, alone, loss_settings).only(slot)
        if not _grads_finite(params):
            _restore_grads(params, kept)
            own = own.flag_nonfinite(slot)
        merged = merged + own
    return merged


def _backward(
    model: nn.Module, lora: MultiLoRA, mb: MicroBatch, loss_settings: Mapping[int, LossSettings]
) -> LossStats:
    with lora.segments(mb.slot_token_counts):
        logits = forward_packed(model, mb)
    result = rl_loss(logits, mb, slot_settings=loss_settings, n_slots=lora.n_slots)
    result.total.backward()
    return result.stats


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    moved = {
        f.name: getattr(mb, f.name).to(device)
        for f in dataclasses.fields(mb)
        if isinstance(getattr(mb, f.name), torch.Tensor)
    }
    return dataclasses.replace(mb, **moved)


def _clone_grads(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _grads_finite(params: list[nn.Parameter]) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)


def _restore_grads(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g
