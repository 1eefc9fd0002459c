"""The per-micro-batch gradient guard of `trainer_core.step`: setting gradients aside and adding the fresh
ones back gives exactly what autograd's own accumulation gives, for every combination of present and
absent gradients, and a non-finite gradient anywhere is seen."""

import pytest
import torch
from torch import nn

from trainer_core import step


def params_and_losses() -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Three parameters; pass 0 reaches a and b, pass 1 reaches b and c (so a has a gradient only from
    before, c only fresh, b both)."""
    gen = torch.Generator().manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(7, 5, generator=gen)) for _ in range(3))
    x = torch.randn(5, 3, generator=gen)
    return [a, b, c], [((a @ x).sin().sum() + (b @ x).square().sum()), ((b @ x).cos().sum() + (c @ x).sum())]


def test_set_aside_and_add_back_equals_autograd_accumulation_bit_for_bit():
    reference, (first, second) = params_and_losses()
    first.backward()
    second.backward()  # autograd accumulates into the existing .grad
    guarded, (first, second) = params_and_losses()
    first.backward()
    earlier = step._take_grads(guarded)
    assert all(p.grad is None for p in guarded)
    second.backward()
    assert step._grads_finite(guarded)
    step._add_back(guarded, earlier)
    for got, want in zip(guarded, reference, strict=True):
        assert got.grad is not None and want.grad is not None
        assert torch.equal(got.grad, want.grad)


def test_restore_puts_back_the_set_aside_gradients_untouched():
    params, (first, second) = params_and_losses()
    first.backward()
    before = [None if p.grad is None else p.grad.clone() for p in params]
    earlier = step._take_grads(params)
    second.backward()
    step._restore_grads(params, earlier)
    for p, want in zip(params, before, strict=True):
        assert (p.grad is None) == (want is None)
        if want is not None:
            assert torch.equal(p.grad, want)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_value_in_any_gradient_is_seen(bad):
    params, (first, _) = params_and_losses()
    first.backward()
    assert step._grads_finite(params)
    params[1].grad[3, 2] = bad
    assert not step._grads_finite(params)
    assert step._grads_finite([])


def test_the_check_leaves_the_gradients_as_they_are():
    params, (first, _) = params_and_losses()
    first.backward()
    before = [p.grad.clone() for p in params if p.grad is not None]
    step._grads_finite(params)
    assert all(
        torch.equal(p.grad, b) for p, b in zip([p for p in params if p.grad is not None], before, strict=True)
    )


def test_a_fresh_gradient_kept_alone_owns_its_storage():
    """The grouped LoRA path gives each slot a view of one shared gradient tensor; kept without an
    earlier gradient to add to, it is copied out, so no run's gradient holds (or would save) another's."""
    from trainer_core.lora import MultiLoRALinear

    layer = MultiLoRALinear(nn.Linear(32, 48), 3, 8)
    params = [p for slot in range(3) for p in layer.slot_parameters(slot)]
    with torch.no_grad():
        for p in params:
            p.normal_()
    earlier = step._take_grads(params)
    layer(torch.randn(9, 32), [3, 3, 3], path="grouped").square().sum().backward()
    assert all(step._in_shared_storage(p.grad) for p in params)  # slices of one tensor, as handed out
    fresh = [p.grad.clone() for p in params]
    step._add_back(params, earlier)
    for p, want in zip(params, fresh, strict=True):
        assert p.grad.untyped_storage().nbytes() == p.grad.numel() * p.grad.element_size()
        assert torch.equal(p.grad, want)
