"""One definition of the losses: a run's loss (`compute_loss` over a packed micro-batch) and the
Tinker API's loss (`tinker_loss` over one datum's logprobs, what `trainer_core.manual` calls) give
the same value and the same gradient on the same tokens."""

import pytest
import torch

from contracts.run_config import LossSettings
from trainer_core.loss import compute_loss
from trainer_core.policy_terms import TinkerLossFn, tinker_loss

torch.set_num_threads(1)

T, V = 12, 7


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=gen)
    input_ids = torch.randint(0, V, (T,), generator=gen)
    advantages = torch.randn(T, generator=gen)
    weights = torch.rand(T, generator=gen)
    # The sampler's logprobs: the trainer's own, moved by up to ±0.5, so ratios lie in [0.6, 1.65]
    # and the [0.8, 1.2] clip binds on some tokens and not on others.
    logp = torch.log_softmax(logits[:-1], -1).gather(1, input_ids[1:, None])[:, 0]
    sampler = torch.cat([torch.zeros(1), logp + (torch.rand(T - 1, generator=gen) - 0.5)])
    return {
        "logits": logits,
        "input_ids": input_ids,
        "advantages": advantages,
        "weights": weights,
        "sampler": sampler,
    }


def _run_path(x: dict[str, torch.Tensor], settings: LossSettings) -> tuple[float, torch.Tensor]:
    """The run loss of one sample whose tokens 1.. carry loss."""
    logits = x["logits"].clone().requires_grad_(True)
    out = compute_loss(
        logits,
        input_ids=x["input_ids"],
        loss_mask=torch.arange(T) > 0,
        advantages=x["advantages"],
        inference_logprobs=x["sampler"],
        temperatures=torch.ones(T),
        token_slots=torch.zeros(T, dtype=torch.long),
        sample_ids=torch.zeros(T, dtype=torch.long),
        settings=[settings],
        n_slots=1,
        weights=x["weights"],
    )
    out.total.backward()
    assert logits.grad is not None
    return float(out.stats.slot(0).loss_sum), logits.grad


def _tinker_path(
    x: dict[str, torch.Tensor], loss_fn: TinkerLossFn, config: dict[str, float]
) -> tuple[float, torch.Tensor]:
    """The Tinker loss of the same tokens as one datum (model input tokens[:-1], targets tokens[1:])."""
    logits = x["logits"].clone().requires_grad_(True)
    lp = torch.log_softmax(logits.float(), dim=-1)[:-1].gather(-1, x["input_ids"][1:, None])[:, 0]
    elementwise = tinker_loss(
        loss_fn,
        lp,
        weights=x["weights"][1:].tolist(),
        sampler_logprobs=x["sampler"][1:].tolist(),
        advantages=x["advantages"][1:].tolist(),
        config=config,
    )
    total = elementwise.sum()
    total.backward()
    assert logits.grad is not None
    return float(total.detach()), logits.grad


CASES = [
    ("ppo", LossSettings(kind="ppo", clip_low=0.2, clip_high=0.2), {}),
    (
        "ppo",
        LossSettings(kind="ppo", clip_low=0.1, clip_high=0.3),
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3},
    ),
    ("cispo", LossSettings(kind="cispo", clip_low=0.2, clip_high=0.2), {}),
    # token_is without masking (bounds wider than any ratio here) is Tinker's importance_sampling.
    ("importance_sampling", LossSettings(kind="token_is", mask_ratio_low=0.01, mask_ratio_high=100.0), {}),
    ("cross_entropy", LossSettings(kind="cross_entropy"), {}),
]


@pytest.mark.parametrize(("loss_fn", "settings", "config"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_run_loss_and_tinker_loss_agree_in_value_and_gradient(loss_fn, settings, config, seed):
    x = _inputs(seed)
    run_value, run_grad = _run_path(x, settings)
    tinker_value, tinker_grad = _tinker_path(x, loss_fn, config)
    assert tinker_value == pytest.approx(run_value, rel=1e-6, abs=1e-6)
    torch.testing.assert_close(tinker_grad, run_grad, rtol=1e-6, atol=1e-7)


def test_the_clip_binds_on_these_inputs():
    """The agreement above covers clipped tokens: ppo and cispo differ from the unclipped loss."""
    x = _inputs(0)
    unclipped, _ = _tinker_path(x, "importance_sampling", {})
    for loss_fn in ("ppo", "cispo"):
        value, _ = _tinker_path(x, loss_fn, {})
        assert abs(value - unclipped) > 1e-3, loss_fn
    ratios = torch.exp(
        torch.log_softmax(x["logits"][:-1], -1).gather(1, x["input_ids"][1:, None])[:, 0] - x["sampler"][1:]
    )
    assert bool(((ratios < 0.8) | (ratios > 1.2)).any()) and bool(((ratios > 0.8) & (ratios < 1.2)).any())
