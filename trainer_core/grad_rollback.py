"""Copies of a run's training state taken before work that may fail half-way, to put it back exactly.

`GradSnapshots`: a forward_backward adds its gradient row by row (one backward per packed row of
seq_len tokens), so a request that fails after one of its rows' backward ran, or whose backward
fails half-way, would leave part of its gradient in the LoRA parameters' `.grad`: applied at the
run's next optim_step, and counted twice when the client sends the request again. The manual
passes copy each run's `.grad` before the first backward that touches the run in a round and put
it back on a failure (trainer_core.manual). A gradient that is None (nothing accumulated since the
run's last optim_step, which sets them to None: the common case of one forward_backward per step)
costs nothing to keep; otherwise one copy of the run's LoRA gradients per round, on their device,
not one per row.

`SlotSnapshot`: a load_weights changes a run's adapter, optimizer state, gradients and step;
one that fails half-way, or on one rank of the pool only, puts all of them back.
"""

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from trainer_core.lora import MultiLoRA
from trainer_core.optim import MultiRunOptimizer
from trainer_core.slots import RunSlot


class GradSnapshots:
    """The `.grad` of slots' LoRA parameters as they were before a round's first backward on them."""

    def __init__(self, lora: MultiLoRA) -> None:
        self._lora = lora
        self._saved: dict[int, list[Tensor | None]] = {}

    def save(self, slot: int) -> None:
        """Keep the slot's gradients, unless kept already this round (then they are the older)."""
        if slot not in self._saved:
            self._saved[slot] = [
                None if p.grad is None else p.grad.detach().clone() for p in self._lora.slot_parameters(slot)
            ]

    def restore(self, slot: int) -> None:
        """The slot's gradients as saved; nothing to do for a slot never saved (no backward touched
        it here). Copies again, so that a slot can be restored more than once."""
        saved = self._saved.get(slot)
        if saved is None:
            return
        for p, grad in zip(self._lora.slot_parameters(slot), saved, strict=True):
            p.grad = None if grad is None else grad.clone()


@dataclass
class SlotSnapshot:
    """A run's adapter, gradients, optimizer state and step, to put back exactly."""

    params: list[Tensor]
    grads: list[Tensor | None]
    optimizer_state: dict[str, Any]
    step: int

    @classmethod
    def take(cls, run: RunSlot, lora: MultiLoRA, optimizer: MultiRunOptimizer) -> "SlotSnapshot":
        params = lora.slot_parameters(run.slot)
        return cls(
            params=[p.detach().clone() for p in params],
            grads=[None if p.grad is None else p.grad.detach().clone() for p in params],
            # state_dict() holds the live moment tensors, which later steps update in place.
            optimizer_state=copy.deepcopy(optimizer.state_dict(run.slot)),
            step=run.progress.step,
        )

    def restore(self, run: RunSlot, lora: MultiLoRA, optimizer: MultiRunOptimizer) -> None:
        """Raises if the state cannot be put back: the caller must not go on with it undefined."""
        params = lora.slot_parameters(run.slot)
        with torch.no_grad():
            for p, value in zip(params, self.params, strict=True):
                p.copy_(value)
        optimizer.load_state_dict(run.slot, self.optimizer_state)
        for p, grad in zip(params, self.grads, strict=True):
            p.grad = grad
        run.progress.step = self.step
