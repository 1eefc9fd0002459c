"""Per-run optimizers, learning-rate schedules and gradient clipping.

Every run (slot) has its own AdamW over its own parameters, its own schedule and its
own loss-token counter. A run's gradients accumulate (as loss SUMS, see ``loss.py``)
over the micro-batches of its step; at its step they are divided by the run's
loss-token count of that step, checked, clipped to the run's ``max_grad_norm`` and
applied — for that run only. Nothing here looks at another run's gradients, which is
what makes a run's update independent of what it was trained next to (DESIGN §4.1).

Independent of ``lora.py`` on purpose: it works on lists of ``nn.Parameter``.
"""

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

from contracts.run_config import OptimSettings, SchedulerSettings


@dataclass
class StepStats:
    """What one run's optimizer step did."""

    grad_norm: float
    """Norm of the normalised gradient before clipping (NaN/Inf when ``nonfinite``)."""
    lr: float
    """Learning rate this step used."""
    loss_tokens: int
    """The normaliser: the run's loss tokens in this step."""
    nonfinite: bool
    """The gradient was not finite: the parameters were NOT updated; the caller evicts the run."""


def lr_factor(step: int, *, scheduler: SchedulerSettings, max_steps: int) -> float:
    """Multiplier of the peak lr used by optimizer step ``step`` (0-based).

    Warmup is linear from ``1 / warmup_steps`` to 1 over the first ``warmup_steps``
    steps (the first step already learns). After it, with ``p = (step - warmup) /
    (max_steps - warmup)`` in [0, 1): ``linear`` goes from 1 towards ``min_lr_ratio``,
    ``cosine`` follows half a cosine from 1 towards ``min_lr_ratio``; ``p`` is clamped to
    1 past ``max_steps``. The last step's lr stays above the floor rather than wasting
    the step at exactly ``min_lr_ratio = 0``.
    """
    warmup = scheduler.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if scheduler.kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    floor = scheduler.min_lr_ratio
    if scheduler.kind == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if scheduler.kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown scheduler kind {scheduler.kind!r}")


def _schedule(scheduler: SchedulerSettings, max_steps: int) -> Callable[[int], float]:
    # A closure on purpose: LambdaLR does not save plain functions in its state_dict,
    # so checkpoints hold only counters, and the schedule comes from the run's config.
    def factor(step: int) -> float:
        return lr_factor(step, scheduler=scheduler, max_steps=max_steps)

    return factor


@dataclass
class _RunOptim:
    params: list[nn.Parameter]
    optimizer: AdamW
    scheduler: LambdaLR
    max_grad_norm: float
    loss_tokens: int = 0
    """Loss tokens accumulated in the current (unfinished) step."""
    loss_weight: float = 0.0
    """The gradient normaliser accumulated in the current step: the loss tokens, or the sum of the
    tokens' weights for a weighted loss (cross_entropy with `weights`)."""


OptimImpl = Literal["loop", "foreach"]
OPTIM_IMPLS: tuple[OptimImpl, ...] = ("loop", "foreach")


class MultiRunOptimizer:
    """One AdamW + one schedule + one loss-token counter per slot.

    ``impl``: how a run's step walks its tensors. ``"foreach"`` (the default): torch's multi-tensor
    kernels over the run's tensors, a few dozen kernel launches per run. ``"loop"``: one tensor at a
    time, about a dozen launches per tensor — 336 tensors for rank-16 LoRA on every linear of a 24-layer
    model, so on an H100 34 ms per run against 6 ms (bench/optimizer_step.py, docs/benchmarks.md); what
    remains of the 6 ms is mostly AdamW's per-tensor Python bookkeeping (``fused=True`` would be next). Either way a run's step reads only its own tensors (its own AdamW), so its
    result does not depend on the other runs nor on the slot it is in; on the CPU the two give
    bit-identical parameters, on CUDA they differ by rounding (1.5e-8 after 3 steps).
    """

    def __init__(self, n_slots: int, *, impl: OptimImpl = "foreach") -> None:
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        if impl not in OPTIM_IMPLS:
            raise ValueError(f"optimizer impl must be one of {list(OPTIM_IMPLS)}, got {impl!r}")
        self.n_slots = n_slots
        self.impl = impl
        self._runs: dict[int, _RunOptim] = {}

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.n_slots})")

    def _run(self, slot: int) -> _RunOptim:
        self._check_slot(slot)
        try:
            return self._runs[slot]
        except KeyError:
            raise KeyError(f"slot {slot} has no optimizer") from None

    def __contains__(self, slot: int) -> bool:
        return slot in self._runs

    @property
    def slots(self) -> list[int]:
        return sorted(self._runs)

    def create(
        self,
        slot: int,
        params: Iterable[nn.Parameter],
        *,
        optim: OptimSettings,
        scheduler: SchedulerSettings,
        max_steps: int,
    ) -> None:
        """Give ``slot`` a fresh optimizer and schedule over ``params`` (in a stable order:
        optimizer state is saved and loaded by position)."""
        self._check_slot(slot)
        if slot in self._runs:
            raise ValueError(f"slot {slot} already has an optimizer; remove it first")
        plist = list(params)
        if not plist:
            raise ValueError(f"slot {slot}: no parameters")
        # A run must not inherit gradients that were accumulated before it existed.
        for p in plist:
            p.grad = None
        opt = AdamW(
            plist,
            lr=optim.lr,
            betas=optim.betas,
            weight_decay=optim.weight_decay,
            foreach=self.impl == "foreach",
        )
        sched = LambdaLR(opt, _schedule(scheduler, max_steps))
        self._runs[slot] = _RunOptim(
            params=plist, optimizer=opt, scheduler=sched, max_grad_norm=optim.max_grad_norm
        )

    def remove(self, slot: int) -> None:
        """Forget ``slot``'s optimizer, schedule and counter; drop its pending gradients."""
        run = self._runs.pop(slot, None)
        if run is not None:
            for p in run.params:
                p.grad = None

    def add_loss_tokens(self, slot: int, n: int | Tensor, weight: float | Tensor | None = None) -> None:
        """Count ``n`` more loss tokens into ``slot``'s current step (already summed over ranks
        when the caller trains with data parallelism); ``weight`` is their share of the normaliser
        (default ``n``: every token weighs 1)."""
        run = self._run(slot)
        run.loss_tokens += int(n)
        run.loss_weight += float(n) if weight is None else float(weight)

    def loss_tokens(self, slot: int) -> int:
        return self._run(slot).loss_tokens

    def current_lr(self, slot: int) -> float:
        """The lr the next step of ``slot`` will use."""
        return float(self._run(slot).optimizer.param_groups[0]["lr"])

    def set_hyperparameters(
        self,
        slot: int,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        max_grad_norm: float,
    ) -> None:
        """Manual stepping (the Tinker API): the next step of ``slot`` uses these, as sent with it.
        The schedule's base lr becomes ``lr`` too, so a constant schedule keeps it exactly."""
        run = self._run(slot)
        for group in run.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, initial_lr=lr)
        run.scheduler.base_lrs = [lr for _ in run.optimizer.param_groups]
        run.max_grad_norm = max_grad_norm

    def step(self, slots: Sequence[int]) -> dict[int, StepStats]:
        """Finish the step of exactly ``slots``; every other slot keeps accumulating."""
        return {slot: self._step_one(slot) for slot in slots}

    @torch.no_grad()
    def _step_one(self, slot: int) -> StepStats:
        run = self._run(slot)
        tokens = run.loss_tokens
        # Guard 0: a step without loss (or weight) has zero gradients; dividing by 1 keeps them zero.
        scale = 1.0 / run.loss_weight if run.loss_weight > 0 else 1.0
        foreach = self.impl == "foreach"
        grads: list[Tensor] = []
        seen: list[Tensor] = []
        for p in run.params:
            if p.grad is None:
                # A parameter that saw no tokens this step has a zero gradient, not none:
                # AdamW then decays its moments exactly as it would for any run.
                p.grad = torch.zeros_like(p)
            else:
                seen.append(p.grad)
            grads.append(p.grad)
        if foreach and seen:
            torch._foreach_mul_(seen, scale)
        else:
            for g in seen:
                g.mul_(scale)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=foreach)
        grad_norm = float(norm)
        lr = self.current_lr(slot)
        nonfinite = not math.isfinite(grad_norm)
        if not nonfinite:
            torch.nn.utils.clip_grads_with_norm_(run.params, run.max_grad_norm, norm, foreach=foreach)
            run.optimizer.step()
            run.scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.loss_tokens = 0
        run.loss_weight = 0.0
        return StepStats(grad_norm=grad_norm, lr=lr, loss_tokens=tokens, nonfinite=nonfinite)

    def zero_grad(self, slot: int) -> None:
        """Drop ``slot``'s accumulated gradients and token count (e.g. a step abandoned on restart)."""
        run = self._run(slot)
        run.optimizer.zero_grad(set_to_none=True)
        run.loss_tokens = 0
        run.loss_weight = 0.0

    def state_dict(self, slot: int) -> dict[str, Any]:
        """Optimizer + scheduler + token counter of ``slot``; loadable with ``torch.load(weights_only=True)``."""
        run = self._run(slot)
        return {
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "loss_tokens": run.loss_tokens,
            "loss_weight": run.loss_weight,
        }

    def load_state_dict(self, slot: int, state: dict[str, Any]) -> None:
        """Restore ``slot`` (created beforehand with the same parameters, in the same order)."""
        run = self._run(slot)
        run.optimizer.load_state_dict(state["optimizer"])
        # A saved param group carries the implementation it was saved with (checkpoints from before
        # "foreach" say foreach=False); this optimizer's own choice wins.
        for group in run.optimizer.param_groups:
            group["foreach"] = self.impl == "foreach"
        run.scheduler.load_state_dict(state["scheduler"])
        run.loss_tokens = int(state.get("loss_tokens", 0))
        run.loss_weight = float(state.get("loss_weight", run.loss_tokens))
