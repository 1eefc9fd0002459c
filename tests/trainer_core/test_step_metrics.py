"""A step's reported metrics, against values computed by hand (issue 10: entropy and mismatch KL are
summed over every scored completion token, masked ones included, so they are averaged over all of
them; dividing by the unmasked tokens alone inflated them by 1 / (1 - masked fraction)).

The model's logits are uniform over a vocabulary of 4, so the trainer's logprob of every token is
-ln 4 and its entropy at every position is ln 4. Each token's inference logprob is set so that its
log ratio `lr = logp - logp_inf` is a chosen number: |lr| small keeps the token, lr = 3 (ratio
e^3 ≈ 20 > 8) masks it. The k3 mismatch KL of a token is e^lr - lr - 1.
"""

import math

import pytest
import torch

from contracts.run_config import LossSettings
from trainer_core.loss import compute_loss
from trainer_core.optim import StepStats
from trainer_core.slots import StepAccumulator

VOCAB = 4
LN4 = math.log(4)


def k3(lr: float) -> float:
    return math.exp(lr) - lr - 1.0


def stats_of(log_ratios: list[float], advantage: float = 1.0):
    """One slot's statistics for one sample: a prompt token, then one completion token per log ratio."""
    n = len(log_ratios) + 1
    logp = -LN4
    stats = compute_loss(
        torch.zeros(n, VOCAB),
        input_ids=torch.tensor([0] + [1] * (n - 1)),
        loss_mask=torch.tensor([False] + [True] * (n - 1)),
        advantages=torch.full((n,), advantage),
        inference_logprobs=torch.tensor([0.0] + [logp - lr for lr in log_ratios]),
        temperatures=torch.ones(n),
        token_slots=torch.zeros(n, dtype=torch.long),
        sample_ids=torch.zeros(n, dtype=torch.long),
        settings={0: LossSettings()},  # ratio bounds [0.125, 8]
        n_slots=1,
    ).stats
    return stats.slot(0)


def metrics_of(*packs: list[float]):
    acc = StepAccumulator()
    for log_ratios in packs:
        acc.add_loss(stats_of(log_ratios))
    return acc.metrics(StepStats(grad_norm=0.5, lr=1e-3, loss_tokens=acc.loss_tokens, nonfinite=False))


def test_unmasked_tokens() -> None:
    m = metrics_of([0.1, -0.2, 0.3, 0.0])
    assert m.entropy == pytest.approx(LN4)  # 1.3862944
    assert m.mismatch_kl == pytest.approx((k3(0.1) + k3(-0.2) + k3(0.3) + 0.0) / 4)  # 0.0184401
    assert m.mismatch_kl == pytest.approx(0.0184401, abs=1e-7)
    assert m.masked_fraction == 0.0
    # loss_t = -ratio * advantage on the kept tokens, averaged over them.
    assert m.loss == pytest.approx(-(math.exp(0.1) + math.exp(-0.2) + math.exp(0.3) + 1.0) / 4)


def test_half_the_tokens_masked() -> None:
    m = metrics_of([0.1, 3.0, -0.2, 3.0])
    assert m.masked_fraction == 0.5
    assert m.entropy == pytest.approx(LN4)  # was 2 ln 4 with the unmasked count as denominator
    assert m.mismatch_kl == pytest.approx((k3(0.1) + k3(-0.2) + 2 * k3(3.0)) / 4)  # 8.0487439
    assert m.mismatch_kl == pytest.approx(8.0487439, abs=1e-6)
    assert m.loss == pytest.approx(-(math.exp(0.1) + math.exp(-0.2)) / 2)  # the loss: kept tokens only


def test_every_token_masked() -> None:
    m = metrics_of([3.0] * 8)
    assert m.masked_fraction == 1.0
    # The example: 8 masked tokens of entropy ln 4 were reported as their sum, 8 ln 4.
    assert m.entropy == pytest.approx(LN4)
    assert m.mismatch_kl == pytest.approx(k3(3.0))  # 16.0855369
    assert m.loss == 0.0


def test_a_step_of_several_packs_averages_over_all_of_them() -> None:
    m = metrics_of([0.1, -0.2], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    assert m.masked_fraction == 0.75
    assert m.entropy == pytest.approx(LN4)
    assert m.mismatch_kl == pytest.approx((k3(0.1) + k3(-0.2) + 6 * k3(3.0)) / 8)
    assert m.grad_norm == 0.5 and m.lr == 1e-3
