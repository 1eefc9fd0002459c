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

Per micro-batch, two extras run only when a run in it asks: one no-grad forward of the frozen base model
without any adapter (`reference_logits`), shared by every run of the micro-batch with ``kl_ref_coef > 0``;
and the last hidden state captured for the value heads of runs with GAE advantages (`trainer_core.critic`).
"""

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from contracts.run_config import AdvantageSettings, LossSettings
from trainer_core.critic import ValueHeads, capture_hidden
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
    advantage_settings: Mapping[int, AdvantageSettings] | None = None,
    value_heads: ValueHeads | None = None,
) -> StepResult:
    """Forward/backward this rank's `micro_batches`, all-reduce, and step the runs in `completing`.

    `loss_settings`: every active slot's loss settings (the slots whose gradients are reduced).
    `completing`: the slots whose step the packer completed with these micro-batches (the same on
    every rank). Filler micro-batches only keep ranks in step: they run no pass.
    `advantage_settings` / `value_heads`: the runs with GAE advantages and their critics (their head
    parameters must be in the run's optimizer and are all-reduced with its LoRA gradients).
    """
    extras = _Extras(advantage_settings or {}, value_heads)
    n_slots = lora.n_slots
    stats = LossStats.zeros(n_slots, device=device)
    for mb in micro_batches:
        if not mb.is_filler:
            stats = stats + backward_isolated(model, lora, _to_device(mb, device), loss_settings, extras)
    active = sorted(loss_settings)
    packed = stats.to_tensor()
    all_reduce_sum_(packed, world)
    stats = LossStats.from_tensor(packed)
    all_reduce_grads_([p for slot in active for p in extras.slot_parameters(lora, slot)], world)

    # One device read per statistic for all slots (per slot, each read would wait for the device).
    tokens, norms, flags = stats.loss_tokens.tolist(), stats.norm.tolist(), stats.nonfinite.tolist()
    for slot in active:
        optimizer.add_loss_tokens(slot, tokens[slot], norms[slot])
    nonfinite = {slot for slot in active if flags[slot]}
    stepped = optimizer.step([slot for slot in sorted(completing) if slot not in nonfinite])
    nonfinite |= {slot for slot, s in stepped.items() if s.nonfinite}
    if not world.is_master:
        # The all-reduce left every rank with the sum so far. The master keeps accumulating on it;
        # the others start their partial steps again from zero, so the next all-reduce adds only
        # their new contributions.
        for slot in active:
            if slot not in stepped:
                for p in extras.slot_parameters(lora, slot):
                    p.grad = None
    return StepResult(
        stats=stats,
        stepped={slot: s for slot, s in stepped.items() if not s.nonfinite},
        nonfinite=nonfinite,
    )


@dataclass
class _Extras:
    """The GAE runs' settings and critics, passed down to each micro-batch's pass."""

    advantage: Mapping[int, AdvantageSettings]
    value_heads: ValueHeads | None

    def gae_slots(self, slots: Collection[int]) -> list[int]:
        return [s for s in sorted(slots) if s in self.advantage and self.advantage[s].estimator == "gae"]

    def slot_parameters(self, lora: MultiLoRA, slot: int) -> list[nn.Parameter]:
        """The run's trained parameters: its LoRA matrices, then its value head if it has a critic."""
        params = lora.slot_parameters(slot)
        if self.value_heads is not None and self.gae_slots([slot]):
            params = params + self.value_heads.slot_parameters(slot)
        return params


def backward_isolated(
    model: nn.Module,
    lora: MultiLoRA,
    mb: MicroBatch,
    loss_settings: Mapping[int, LossSettings],
    extras: _Extras | None = None,
) -> LossStats:
    """Forward/backward one micro-batch; a run whose gradients blow up cannot poison the others.

    The loss already drops a run whose loss is non-finite. But a finite loss can still overflow in
    the backward pass, and the shared base-model backward then spreads Inf/NaN to every run in the
    row (masked attention gives 0 × Inf). So: keep the gradients from before this micro-batch; if
    any present run's gradients come out non-finite, go back to them and redo the row once per run,
    keeping each run's result only if it is finite. The failing run is reported non-finite (and
    evicted by the caller); the others get exactly their own gradients.

    The gradients from before are set aside (not copied) and the pass writes fresh ones: those are
    checked, then added to the set-aside ones — the same sums autograd would have accumulated, bit for
    bit. Check and add are multi-tensor kernels, a handful of launches whatever the number of tensors
    (a clone and a host-synchronising check per tensor cost thousands per micro-batch on a GPU:
    bench/grad_guard.py). A sum that overflows only there is caught by the run's optimizer step, which
    reports it non-finite too.
    """
    extras = extras or _Extras({}, None)
    present = [
        slot for slot, n in enumerate(mb.slot_token_counts.tolist()) if n > 0 and slot in loss_settings
    ]
    groups = [extras.slot_parameters(lora, slot) for slot in present]
    params = [p for group in groups for p in group]
    before = _take_grads(params)
    stats = _backward(model, lora, mb, loss_settings, extras)
    if _grads_finite(params):
        _add_back(params, before)
        return stats
    _restore_grads(params, before)
    merged = LossStats.zeros(lora.n_slots, device=stats.loss_sum.device)
    start = 0
    for slot, group in zip(present, groups, strict=True):
        alone = dataclasses.replace(mb, loss_mask=mb.loss_mask & (mb.token_slots == slot))
        kept = _take_grads(params)
        own = _backward(model, lora, alone, loss_settings, extras).only(slot)
        mine = slice(start, start + len(group))
        start += len(group)
        # Only the slot's own gradients are judged and kept. The others' fresh ones carry no loss of
        # theirs (zero, or NaN where their own adapter overflows: 0 × Inf) and are dropped: a run
        # whose adapter diverged must not get its neighbours evicted.
        others = params[: mine.start] + params[mine.stop :]
        _restore_grads(others, kept[: mine.start] + kept[mine.stop :])
        if _grads_finite(group):
            _add_back(group, kept[mine])
        else:
            _restore_grads(group, kept[mine])
            own = own.flag_nonfinite(slot)
        merged = merged + own
    return merged


def reference_logits(model: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """(L, V) logits of the reference policy: the frozen base model with no adapter (no segment layout
    is installed, so every multi-LoRA layer returns its base layer's output), without gradient."""
    with torch.no_grad():
        return forward_packed(model, mb)


def _backward(
    model: nn.Module,
    lora: MultiLoRA,
    mb: MicroBatch,
    loss_settings: Mapping[int, LossSettings],
    extras: _Extras,
) -> LossStats:
    with_loss = set(mb.token_slots[mb.loss_mask].unique().tolist()) & set(loss_settings)
    # One reference forward per micro-batch, however many of its runs ask for the reference KL.
    ref = reference_logits(model, mb) if any(loss_settings[s].kl_ref_coef > 0 for s in with_loss) else None
    gae = extras.gae_slots(with_loss)
    if gae and extras.value_heads is None:
        raise ValueError(f"slots {gae} use GAE advantages but the step has no value heads")
    values = None
    with lora.segments(mb.slot_token_counts):
        if gae:
            assert extras.value_heads is not None
            with capture_hidden(model) as hidden:
                logits = forward_packed(model, mb)
            values = extras.value_heads(hidden[0][0], mb.token_slots, gae)  # (L,)
        else:
            logits = forward_packed(model, mb)
    result = rl_loss(
        logits,
        mb,
        slot_settings=loss_settings,
        n_slots=lora.n_slots,
        ref_logits=ref,
        values=values,
        advantage_settings=extras.advantage,
    )
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


def _take_grads(params: list[nn.Parameter]) -> list[torch.Tensor | None]:
    """The parameters' gradients, set aside: the next backward writes fresh ones."""
    taken = [p.grad for p in params]
    for p in params:
        p.grad = None
    return taken


def _grads_finite(params: list[nn.Parameter]) -> bool:
    """Whether every gradient is finite: one multi-tensor check (GradScaler's, with a scale of 1, which
    leaves the values as they are) and one read on the host."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
    one = torch.ones(1, dtype=torch.float32, device=grads[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return not bool(found)


def _add_back(params: list[nn.Parameter], earlier: list[torch.Tensor | None]) -> None:
    """Each parameter's gradient := the set-aside one + the fresh one, in place in the set-aside tensor.

    A fresh gradient with nothing set aside stays, but not as a view: the grouped LoRA path hands each
    slot a slice of one tensor shared by the micro-batch's slots, and a run's gradient must neither keep
    the others' alive while it accumulates nor carry them along if it is ever saved. One multi-tensor
    copy."""
    views = [p for p, old in zip(params, earlier, strict=True) if old is None and _in_shared_storage(p.grad)]
    if views:
        for p, own in zip(views, torch._foreach_mul([p.grad for p in views], 1.0), strict=True):  # type: ignore[misc]
            p.grad = own
    pairs = [(p, old) for p, old in zip(params, earlier, strict=True) if old is not None]
    fresh = [(p, old, p.grad) for p, old in pairs if p.grad is not None]
    if fresh:
        torch._foreach_add_([old for _, old, _ in fresh], [new for _, _, new in fresh])
    for p, old in pairs:
        p.grad = old


def _in_shared_storage(grad: torch.Tensor | None) -> bool:
    """Whether the tensor is a part of a larger storage (autograd detaches a view it keeps as a gradient,
    so ``_base`` does not tell)."""
    return grad is not None and grad.untyped_storage().nbytes() != grad.numel() * grad.element_size()


def _restore_grads(params: list[nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g
