"""Per-run optimizers: schedules, ready-only steps, per-run clipping, reset isolation, NaN."""

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from contracts.run_config import OptimSettings, SchedulerSettings
from trainer_core.lora import MultiLoRA, apply_multi_lora
from trainer_core.optim import MultiRunOptimizer, lr_factor

torch.set_num_threads(1)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-identical nested state (dicts, lists, tensors, numbers)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _params(seed: int, shapes=((4, 3), (3,))) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def _accumulate(params: list[nn.Parameter], seed: int, scale: float = 1.0) -> None:
    """Add a deterministic pseudo-gradient (as a loss sum's backward would)."""
    gen = torch.Generator().manual_seed(seed)
    loss = torch.stack(
        [(p * torch.randn(p.shape, generator=gen)).sum() * scale + (p**2).sum() for p in params]
    )
    loss.sum().backward()


def test_lr_factor_curves():
    cos = SchedulerSettings(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
    lin = SchedulerSettings(kind="linear", warmup_steps=2, min_lr_ratio=0.1)
    const = SchedulerSettings(kind="constant", warmup_steps=2)
    for s in (cos, lin, const):
        # Warmup from 1/warmup: the first step already learns.
        assert lr_factor(0, scheduler=s, max_steps=10) == pytest.approx(0.5)
        assert lr_factor(1, scheduler=s, max_steps=10) == pytest.approx(1.0)
        assert lr_factor(2, scheduler=s, max_steps=10) == pytest.approx(1.0)
    # Halfway through the decay (p = (6 - 2) / 8): both at the midpoint between 1 and 0.1.
    assert lr_factor(6, scheduler=cos, max_steps=10) == pytest.approx(0.55)
    assert lr_factor(6, scheduler=lin, max_steps=10) == pytest.approx(0.55)
    # A quarter: cosine is still high, linear is at 0.775.
    assert lr_factor(4, scheduler=cos, max_steps=10) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi / 4))
    )
    assert lr_factor(4, scheduler=lin, max_steps=10) == pytest.approx(0.775)
    # The last step stays above the floor; past max_steps, the floor.
    assert lr_factor(9, scheduler=lin, max_steps=10) == pytest.approx(0.1 + 0.9 / 8)
    assert lr_factor(12, scheduler=cos, max_steps=10) == pytest.approx(0.1)
    assert lr_factor(7, scheduler=const, max_steps=10) == 1.0
    no_warmup = SchedulerSettings(kind="cosine")
    assert lr_factor(0, scheduler=no_warmup, max_steps=4) == 1.0


def test_each_run_follows_its_own_schedule():
    kinds = {
        0: SchedulerSettings(kind="constant"),
        1: SchedulerSettings(kind="linear", warmup_steps=1, min_lr_ratio=0.0),
        2: SchedulerSettings(kind="cosine", warmup_steps=3, min_lr_ratio=0.2),
    }
    peaks = {0: 1e-3, 1: 5e-4, 2: 2e-2}
    params = {slot: _params(slot) for slot in kinds}
    opt = MultiRunOptimizer(n_slots=3)
    for slot, sched in kinds.items():
        opt.create(slot, params[slot], optim=OptimSettings(lr=peaks[slot]), scheduler=sched, max_steps=6)
    for step in range(8):
        for slot in kinds:
            _accumulate(params[slot], seed=step)
            opt.add_loss_tokens(slot, 3)
        stats = opt.step([0, 1, 2])
        for slot, sched in kinds.items():
            want = peaks[slot] * lr_factor(step, scheduler=sched, max_steps=6)
            assert stats[slot].lr == pytest.approx(want, rel=1e-12)
            assert opt.current_lr(slot) == pytest.approx(
                peaks[slot] * lr_factor(step + 1, scheduler=sched, max_steps=6)
            )


def test_only_ready_slots_step_and_others_keep_accumulating():
    params = {slot: _params(10 + slot) for slot in range(3)}
    opt = MultiRunOptimizer(n_slots=3)
    for slot in range(3):
        opt.create(
            slot, params[slot], optim=OptimSettings(lr=0.1), scheduler=SchedulerSettings(), max_steps=5
        )
        _accumulate(params[slot], seed=slot)
        opt.add_loss_tokens(slot, 4)
    before = {s: [p.detach().clone() for p in ps] for s, ps in params.items()}
    grads = {s: [p.grad.clone() for p in ps] for s, ps in params.items()}

    stats = opt.step([1])
    assert list(stats) == [1] and stats[1].loss_tokens == 4
    assert any(not torch.equal(p, b) for p, b in zip(params[1], before[1], strict=True))
    assert all(p.grad is None for p in params[1]) and opt.loss_tokens(1) == 0
    for slot in (0, 2):
        assert all(torch.equal(p, b) for p, b in zip(params[slot], before[slot], strict=True))
        assert all(torch.equal(p.grad, g) for p, g in zip(params[slot], grads[slot], strict=True))
        assert opt.loss_tokens(slot) == 4
        assert opt.state_dict(slot)["optimizer"]["state"] == {}

    # Slot 0 accumulates a second micro-batch; its step divides the sum by all 7 tokens.
    _accumulate(params[0], seed=99)
    opt.add_loss_tokens(0, 3)
    assert opt.step([0])[0].loss_tokens == 7


def test_clipping_is_per_run():
    """B's gradient 1e4x larger changes nothing of A's update; B is clipped to its own norm."""
    settings = {0: OptimSettings(lr=0.01, max_grad_norm=0.5), 1: OptimSettings(lr=0.02, max_grad_norm=2.0)}
    results = []
    for b_scale in (1.0, 1e4):
        params = {slot: _params(20 + slot) for slot in range(2)}
        opt = MultiRunOptimizer(n_slots=2)
        for slot in range(2):
            opt.create(slot, params[slot], optim=settings[slot], scheduler=SchedulerSettings(), max_steps=5)
        seen: dict[int, float] = {}

        def record(optimizer, args, kwargs, seen=seen, params=params):
            owner = next(s for s, ps in params.items() if ps[0] is optimizer.param_groups[0]["params"][0])
            seen[owner] = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params[owner]])))

        handle = register_optimizer_step_pre_hook(record)
        try:
            for step in range(3):
                _accumulate(params[0], seed=step)
                _accumulate(params[1], seed=100 + step, scale=b_scale)
                opt.add_loss_tokens(0, 5)
                opt.add_loss_tokens(1, 2)
                stats = opt.step([0, 1])
                assert seen[1] <= 2.0 * (1 + 1e-5) and seen[0] <= 0.5 * (1 + 1e-5)
        finally:
            handle.remove()
        results.append((params, stats))
    (p_small, s_small), (p_big, s_big) = results
    assert all(torch.equal(a, b) for a, b in zip(p_small[0], p_big[0], strict=True))
    assert s_small[0].grad_norm == s_big[0].grad_norm
    assert s_big[1].grad_norm > 1e3 * s_small[1].grad_norm  # reported before clipping


def test_nonfinite_gradient_is_reported_and_not_applied():
    params = {slot: _params(30 + slot) for slot in range(2)}
    opt = MultiRunOptimizer(n_slots=2)
    for slot in range(2):
        opt.create(
            slot, params[slot], optim=OptimSettings(lr=0.1), scheduler=SchedulerSettings(), max_steps=5
        )
        _accumulate(params[slot], seed=slot)
        opt.add_loss_tokens(slot, 3)
    params[1][0].grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in params[1]]
    lr_before = opt.current_lr(1)

    stats = opt.step([0, 1])
    assert not stats[0].nonfinite and math.isfinite(stats[0].grad_norm)
    assert stats[1].nonfinite and math.isnan(stats[1].grad_norm)
    assert all(torch.equal(p, b) for p, b in zip(params[1], before, strict=True))
    assert opt.state_dict(1)["optimizer"]["state"] == {}  # no moment was touched
    assert opt.state_dict(1)["scheduler"]["last_epoch"] == 0 and opt.current_lr(1) == lr_before
    assert all(p.grad is None for p in params[1]) and opt.loss_tokens(1) == 0
    assert opt.state_dict(0)["scheduler"]["last_epoch"] == 1


def _train_plain(reset_slot_1: bool) -> tuple[dict, MultiRunOptimizer]:
    params = {slot: _params(40 + slot) for slot in range(3)}
    opt = MultiRunOptimizer(n_slots=3)
    optim = {s: OptimSettings(lr=0.01 * (s + 1), weight_decay=0.1 * s, betas=(0.8, 0.99)) for s in range(3)}
    sched = SchedulerSettings(kind="cosine", warmup_steps=1, min_lr_ratio=0.1)
    for slot in range(3):
        opt.create(slot, params[slot], optim=optim[slot], scheduler=sched, max_steps=6)
    for step in range(4):
        if step == 2 and reset_slot_1:
            opt.remove(1)
            with torch.no_grad():
                for p, fresh in zip(params[1], _params(77), strict=True):
                    p.copy_(fresh)
            opt.create(1, params[1], optim=OptimSettings(lr=0.5), scheduler=SchedulerSettings(), max_steps=3)
        for slot in range(3):
            _accumulate(params[slot], seed=step * 10 + slot)
            opt.add_loss_tokens(slot, 2 + slot)
        opt.step([0, 1, 2])
    return params, opt


def test_reset_of_one_slot_leaves_the_others_bit_identical():
    p_ref, o_ref = _train_plain(reset_slot_1=False)
    p_rst, o_rst = _train_plain(reset_slot_1=True)
    for slot in (0, 2):
        assert all(torch.equal(a, b) for a, b in zip(p_ref[slot], p_rst[slot], strict=True))
        assert_same(o_ref.state_dict(slot), o_rst.state_dict(slot))
    assert not torch.equal(p_ref[1][0], p_rst[1][0])


class _TwoProj(nn.Module):
    """The smallest module apply_multi_lora can wrap: two target linears."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.q_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, x):
        return self.v_proj(torch.tanh(self.q_proj(x)))


def _train_lora(reset_slot_1: bool) -> tuple[MultiLoRA, MultiRunOptimizer]:
    model = _TwoProj()
    lora = apply_multi_lora(model, ["q_proj", "v_proj"], n_slots=3, max_rank=4, path="loop")
    opt = MultiRunOptimizer(n_slots=3)

    def create(slot: int, rank: int, lr: float) -> None:
        lora.configure_slot(slot, rank=rank, alpha=2.0 * rank)
        lora.reset_slot(slot, seed=slot * 7 + rank)
        opt.create(
            slot,
            lora.slot_parameters(slot),
            optim=OptimSettings(lr=lr),
            scheduler=SchedulerSettings(),
            max_steps=5,
        )

    for slot, rank in enumerate((4, 2, 3)):
        create(slot, rank, lr=0.01 * (slot + 1))
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 2 and reset_slot_1:
            opt.remove(1)
            create(1, rank=1, lr=0.3)
        counts = [3, 2, 4]
        x = torch.randn(sum(counts), 8, generator=gen)
        with lora.segments(counts):
            y = model(x)
        (y * torch.randn(y.shape, generator=gen)).sum().backward()
        for slot in range(3):
            opt.add_loss_tokens(slot, counts[slot])
        opt.step([0, 1, 2])
    return lora, opt


def test_reset_with_multi_lora_leaves_the_others_bit_identical():
    l_ref, o_ref = _train_lora(reset_slot_1=False)
    l_rst, o_rst = _train_lora(reset_slot_1=True)
    for slot in (0, 2):
        assert_same(l_ref.slot_state_dict(slot), l_rst.slot_state_dict(slot))
        assert_same(o_ref.state_dict(slot), o_rst.state_dict(slot))
    assert l_rst.slot_config(1).rank == 1


def test_lifecycle_errors_and_remove_drops_pending_grads():
    params = _params(50)
    opt = MultiRunOptimizer(n_slots=2)
    opt.create(0, params, optim=OptimSettings(), scheduler=SchedulerSettings(), max_steps=3)
    with pytest.raises(ValueError, match="already has an optimizer"):
        opt.create(0, params, optim=OptimSettings(), scheduler=SchedulerSettings(), max_steps=3)
    with pytest.raises(IndexError):
        opt.create(2, params, optim=OptimSettings(), scheduler=SchedulerSettings(), max_steps=3)
    _accumulate(params, seed=1)
    opt.add_loss_tokens(0, 5)
    opt.remove(0)
    assert all(p.grad is None for p in params) and 0 not in opt
    with pytest.raises(KeyError):
        opt.step([0])


def test_foreach_and_loop_steps_give_the_same_parameters_on_cpu():
    """The default multi-tensor step is the per-tensor loop's arithmetic: bit-identical on the CPU, with
    clipping, a parameter without gradient and weight decay in play."""
    finals = {}
    for impl in ("loop", "foreach"):
        opt = MultiRunOptimizer(2, impl=impl)
        params = [_params(seed=slot, shapes=((4, 3), (3,), (5, 2))) for slot in range(2)]
        for slot in range(2):
            settings = OptimSettings(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
            opt.create(slot, params[slot], optim=settings, scheduler=SchedulerSettings(), max_steps=10)
        for step in range(4):
            for slot in range(2):
                _accumulate(params[slot][:2], seed=10 * step + slot, scale=3.0)  # the third gets none
                opt.add_loss_tokens(slot, 7)
            stats = opt.step([0, 1])
            assert all(s.grad_norm > 0.5 for s in stats.values())  # clipping is exercised
        finals[impl] = [p.detach().clone() for ps in params for p in ps]
    assert_same(finals["loop"], finals["foreach"])


def test_unknown_optimizer_impl_is_a_clear_error():
    with pytest.raises(ValueError, match=r"optimizer impl must be one of \['loop', 'foreach'\], got 'fused'"):
        MultiRunOptimizer(2, impl="fused")


def test_a_checkpoint_of_the_loop_optimizer_loads_into_foreach():
    """Checkpoints written before the multi-tensor default say foreach=False in their param groups; a run
    resumed from one takes this optimizer's implementation, not the saved one."""
    old = MultiRunOptimizer(1, impl="loop")
    old.create(0, _params(seed=1), optim=OptimSettings(lr=1e-2), scheduler=SchedulerSettings(), max_steps=5)
    saved = old.state_dict(0)
    assert saved["optimizer"]["param_groups"][0]["foreach"] is False
    new = MultiRunOptimizer(1)
    new.create(0, _params(seed=1), optim=OptimSettings(lr=1e-2), scheduler=SchedulerSettings(), max_steps=5)
    new.load_state_dict(0, saved)
    assert new._run(0).optimizer.param_groups[0]["foreach"] is True
