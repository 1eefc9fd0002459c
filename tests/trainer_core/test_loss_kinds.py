"""The loss kinds of `config.loss.kind` against references written token by token, with the case analysis
spelled out (values and gradients): cross_entropy, ppo (clip boundaries, asymmetric, dual clip), cispo, the
reference-KL estimators, the entropy bonus and the GAE critic's advantages and value loss."""

import math

import pytest
import torch

from contracts.run_config import AdvantageSettings, LossSettings, RunConfig
from trainer_core.critic import gae_advantages, gae_reference
from trainer_core.loss import compute_loss

torch.set_num_threads(1)

V = 5
IDS = [0, 3, 1, 4, 2, 0, 1]  # token 0 is the prompt; 1..6 are completion tokens
T = len(IDS)
ADV = [0.0, 1.0, 1.0, -1.0, -1.0, 2.0, -0.5]


def _logits(seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(T, V, generator=g, dtype=torch.float64)).float().requires_grad_(True)


def _logp(logits: torch.Tensor, temp: float = 1.0) -> list[torch.Tensor]:
    """Token t's logprob (t = 1..T-1), differentiable, from logits[t-1] / temp."""
    return [torch.log_softmax(logits[t - 1] / temp, dim=-1)[IDS[t]] for t in range(1, T)]


def _batch(ilp: list[float], **overrides):
    batch = dict(
        input_ids=torch.tensor(IDS),
        loss_mask=torch.tensor([False] + [True] * (T - 1)),
        advantages=torch.tensor(ADV),
        inference_logprobs=torch.tensor(ilp, dtype=torch.float32),
        temperatures=torch.ones(T),
        token_slots=torch.zeros(T, dtype=torch.long),
        sample_ids=torch.zeros(T, dtype=torch.long),
    )
    batch.update(overrides)
    return batch


def _ilp_for_ratios(logits: torch.Tensor, ratios: list[float]) -> list[float]:
    """Inference logprobs that give token t the importance ratio ratios[t-1]."""
    with torch.no_grad():
        lp = [float(x) for x in _logp(logits)]
    return [0.0] + [lp[i] - math.log(r) for i, r in enumerate(ratios)]


def _compare(logits, ours, reference: torch.Tensor, ref_logits=None) -> None:
    """Values and gradients (w.r.t. the logits) of our total against the reference's."""
    assert ours.total.item() == pytest.approx(reference.item(), rel=1e-5, abs=1e-6)
    (g_ours,) = torch.autograd.grad(ours.total, logits)
    (g_ref,) = torch.autograd.grad(reference, logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-6), (g_ours - g_ref).abs().max()


def test_ppo_clip_boundaries_asymmetric_clip_and_dual_clip():
    logits = _logits()
    cl, ch = 0.2, 0.28  # DAPO-style clip-higher
    # Tokens: A>0 inside (1.25 < 1.28), A>0 above (1.3), A<0 below (0.75 < 0.8), A<0 inside (0.85),
    # A>0 just inside the upper bound, A<0 with a huge ratio (dual clip binds at 3).
    ratios = [1.25, 1.3, 0.75, 0.85, 1.279, 5.0]
    ilp = _ilp_for_ratios(logits, ratios)
    for dual in (None, 3.0):
        settings = LossSettings(kind="ppo", clip_low=cl, clip_high=ch, dual_clip=dual)
        ours = compute_loss(logits, **_batch(ilp), settings=[settings], n_slots=1)
        ref = torch.zeros(())
        for t, lp in enumerate(_logp(logits), start=1):
            r = torch.exp(lp - ilp[t])
            a = ADV[t]
            if a >= 0:
                loss = -(1 + ch) * a * torch.ones(()) if float(r.detach()) > 1 + ch else -r * a
            else:
                loss = -(1 - cl) * a * torch.ones(()) if float(r.detach()) < 1 - cl else -r * a
                if dual is not None and float(r.detach()) > dual:
                    loss = -dual * a * torch.ones(())
            ref = ref + loss
        _compare(logits, ours, ref)
        assert ours.stats.slot(0).loss_tokens == T - 1 and ours.stats.slot(0).masked_tokens == 0


def test_ppo_gradient_is_zero_beyond_the_clip_in_the_advantage_direction():
    logits = _logits(1)
    ilp = _ilp_for_ratios(logits, [1.5, 1.5, 1.5, 1.5, 1.5, 1.5])
    adv = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # all clipped from above
    ours = compute_loss(logits, **_batch(ilp, advantages=adv), settings=[LossSettings(kind="ppo")], n_slots=1)
    assert ours.total.item() == pytest.approx(-1.2 * 6, rel=1e-6)
    (g,) = torch.autograd.grad(ours.total, logits)
    assert float(g.abs().max()) == 0.0


def test_cispo_is_stop_gradient_clipped_weight_times_logprob():
    logits = _logits(2)
    ratios = [1.5, 0.5, 1.0, 3.0, 0.1, 1.1]
    ilp = _ilp_for_ratios(logits, ratios)
    settings = LossSettings(kind="cispo", clip_low=0.3, clip_high=0.4)
    ours = compute_loss(logits, **_batch(ilp), settings=[settings], n_slots=1)
    ref = torch.zeros(())
    for t, lp in enumerate(_logp(logits), start=1):
        weight = min(max(ratios[t - 1], 0.7), 1.4)  # a Python float: no gradient through it
        ref = ref - weight * ADV[t] * lp
    _compare(logits, ours, ref)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_estimators(estimator):
    logits, ref_logits = _logits(3), _logits(4).detach()
    ilp = _ilp_for_ratios(logits, [1.0] * (T - 1))
    adv = torch.zeros(T)  # the policy term vanishes: only the KL is left
    coef = 0.7
    settings = LossSettings(kind="ppo", kl_ref_coef=coef, kl_ref_estimator=estimator)
    ours = compute_loss(
        logits, **_batch(ilp, advantages=adv), settings=[settings], n_slots=1, ref_logits=ref_logits
    )
    ref = torch.zeros(())
    for lp, lp_ref in zip(_logp(logits), _logp(ref_logits), strict=True):
        log_q = lp - lp_ref  # log(pi_theta / pi_ref)
        k = {"k1": log_q, "k2": 0.5 * log_q**2, "k3": torch.exp(-log_q) + log_q - 1.0}[estimator]
        ref = ref + coef * k
    _compare(logits, ours, ref)
    # The hand-derived gradient w.r.t. logp: k1 -> 1, k2 -> log q, k3 -> 1 - pi_ref / pi_theta.
    lp = torch.stack(_logp(logits)).detach().requires_grad_(True)
    lpr = torch.stack(_logp(ref_logits))
    lq = lp - lpr
    k = {"k1": lq, "k2": 0.5 * lq**2, "k3": torch.exp(-lq) + lq - 1.0}[estimator]
    (grad,) = torch.autograd.grad(k.sum(), lp)
    want = {"k1": torch.ones_like(lq), "k2": lq, "k3": 1.0 - torch.exp(-lq)}[estimator]
    assert torch.allclose(grad, want.detach(), atol=1e-6)


def test_reference_kl_is_zero_when_the_policy_is_the_reference():
    logits = _logits(5)
    ilp = _ilp_for_ratios(logits, [1.0] * (T - 1))
    settings = LossSettings(kind="token_is", kl_ref_coef=1.0, kl_ref_estimator="k3")
    out = compute_loss(
        logits,
        **_batch(ilp, advantages=torch.zeros(T)),
        settings=[settings],
        n_slots=1,
        ref_logits=logits.detach(),
    )
    assert abs(out.total.item()) < 1e-6
    (g,) = torch.autograd.grad(out.total, logits)
    assert float(g.abs().max()) < 1e-6


def test_entropy_bonus():
    logits = _logits(6)
    ilp = _ilp_for_ratios(logits, [1.0] * (T - 1))
    coef, temp = 0.3, 0.7
    batch = _batch(ilp, advantages=torch.zeros(T), temperatures=torch.full((T,), temp))
    # The ratios above were computed at temperature 1: recompute the IS term's reference at 0.7 too.
    settings = LossSettings(kind="token_is", entropy_coef=coef, mask_ratio_low=1e-3, mask_ratio_high=1e3)
    ours = compute_loss(logits, **batch, settings=[settings], n_slots=1)
    ref = torch.zeros(())
    for t in range(1, T):
        lp_all = torch.log_softmax(logits[t - 1] / temp, dim=-1)
        ref = ref - coef * -(lp_all.exp() * lp_all).sum()
    _compare(logits, ours, ref)


def test_sft_with_weights_is_the_weighted_mean_cross_entropy():
    logits = _logits(7)
    weights = torch.tensor([0.0, 1.0, 0.5, 2.0, 0.0, 1.5, 3.0])
    batch = _batch([0.0] * T, advantages=torch.zeros(T))
    out = compute_loss(
        logits, **batch, settings=[LossSettings(kind="cross_entropy")], n_slots=1, weights=weights
    )
    ce = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(IDS[1:]), reduction="none")
    w = weights[1:]
    want = (w * ce).sum() / w.sum()
    stats = out.stats.slot(0)
    assert stats.normaliser == pytest.approx(float(w.sum()))
    mean = out.total / stats.normaliser
    _compare(logits, type(out)(total=mean, stats=out.stats), want)
    # Without weights: the plain mean over loss tokens, normalised by their count.
    plain = compute_loss(logits, **batch, settings=[LossSettings(kind="cross_entropy")], n_slots=1)
    assert plain.stats.slot(0).normaliser == T - 1
    assert plain.total.item() / (T - 1) == pytest.approx(float(ce.mean()), rel=1e-6)


def test_mixed_kinds_in_one_row_sum_per_slot():
    """Slot 0 cross_entropy, slot 1 ppo, slot 2 cispo in one packed row: each slot's sum is what its
    kind gives alone, and its gradient rows are its own."""
    logits = _logits(8)
    ilp = _ilp_for_ratios(logits, [1.1, 0.9, 1.5, 1.0, 0.6, 1.2])
    slots = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    sids = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    # Each sample's first token carries no loss: loss tokens are 1, 2 (slot 0), 4 (slot 1), 6 (slot 2).
    mask = torch.tensor([False, True, True, False, True, False, True])
    settings = [
        LossSettings(kind="cross_entropy"),
        LossSettings(kind="ppo", clip_high=0.3),
        LossSettings(kind="cispo"),
    ]
    together = compute_loss(
        logits,
        **_batch(ilp, token_slots=slots, sample_ids=sids, loss_mask=mask),
        settings=settings,
        n_slots=3,
    )
    for slot in range(3):
        alone = compute_loss(
            logits,
            **_batch(ilp, token_slots=slots, sample_ids=sids, loss_mask=mask & (slots == slot)),
            settings=settings,
            n_slots=3,
        )
        assert together.stats.slot(slot).loss_sum == pytest.approx(alone.stats.slot(slot).loss_sum)
        assert together.stats.slot(slot).normaliser == alone.stats.slot(slot).normaliser


# ----------------------------------------------------------------------------------------------- GAE


def _gae_by_hand(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    """GAE as the definition's sum: A_t = sum_k (gamma lam)^k delta_{t+k}."""
    n = len(r)
    delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
    return [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]


@pytest.mark.parametrize("gamma", [1.0, 0.95])
@pytest.mark.parametrize("lam", [1.0, 0.95])
def test_gae_on_a_five_token_example(gamma, lam):
    r = [0.0, 0.5, 0.0, -1.0, 2.0]
    v = [0.3, -0.2, 0.1, 0.4, 0.6]
    want = _gae_by_hand(r, v, gamma, lam)
    if gamma == lam == 1.0:  # then A_t = (sum of rewards from t) - V_t
        assert want == pytest.approx([sum(r[t:]) - v[t] for t in range(5)])
    assert gae_reference(r, v, gamma, lam) == pytest.approx(want)
    # Two samples back to back: the recursion restarts at each sample (V after a sample's end is 0).
    adv, ret = gae_advantages(
        rewards=torch.tensor(r + r),
        values=torch.tensor(v + v),
        sample_ids=torch.tensor([0] * 5 + [1] * 5),
        gamma=torch.full((10,), gamma),
        lam=torch.full((10,), lam),
        active=torch.ones(10, dtype=torch.bool),
    )
    assert adv.tolist() == pytest.approx(want + want, abs=1e-6)
    assert ret.tolist() == pytest.approx([a + b for a, b in zip(want + want, v + v, strict=True)], abs=1e-6)


def test_gae_run_trains_on_its_own_advantages_and_value_loss():
    """A GAE run ignores the sent advantages: its policy term uses GAE from its values, and its value
    loss is the Huber loss of V - R; values at position t-1 score token t."""
    logits = _logits(9)
    ilp = _ilp_for_ratios(logits, [1.0] * (T - 1))
    values = torch.tensor([0.2, -0.1, 0.4, 0.0, 0.3, -0.5, 9.9], requires_grad=True)  # the last: no token
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 2.0])
    adv_cfg = AdvantageSettings(estimator="gae", gamma=0.95, lam=0.9, value_coef=0.5, value_clip=0.5)
    settings = LossSettings(kind="token_is", mask_ratio_low=1e-3, mask_ratio_high=1e3)
    out = compute_loss(
        logits,
        **_batch(ilp, advantages=torch.full((T,), 100.0)),  # ignored
        settings=[settings],
        n_slots=1,
        values=values,
        rewards=rewards,
        advantage_settings=[adv_cfg],
    )
    v = values.detach()[:-1].tolist()  # token t's value is values[t-1]
    r = rewards[1:].tolist()
    adv = gae_reference(r, v, 0.95, 0.9)
    ref = torch.zeros(())
    for t, lp in enumerate(_logp(logits), start=1):
        ratio = torch.exp(lp - ilp[t])
        e = values[t - 1] - (adv[t - 1] + v[t - 1])
        huber = 0.5 * e**2 if abs(float(e)) <= 0.5 else 0.5 * (e.abs() - 0.25)
        ref = ref - ratio * adv[t - 1] + 0.5 * huber
    assert out.total.item() == pytest.approx(ref.item(), rel=1e-5)
    g_ours = torch.autograd.grad(out.total, [logits, values])
    g_ref = torch.autograd.grad(ref, [logits, values])
    for a, b in zip(g_ours, g_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_config_rules():
    with pytest.raises(ValueError, match="kl_ref_coef apply to RL kinds only"):
        LossSettings(kind="cross_entropy", kl_ref_coef=0.1)
    with pytest.raises(ValueError, match="dual_clip applies to kind 'ppo' only"):
        LossSettings(kind="cispo", dual_clip=3.0)
    with pytest.raises(ValueError, match="needs an RL loss kind"):
        RunConfig(loss=LossSettings(kind="cross_entropy"), advantage=AdvantageSettings(estimator="gae"))
    with pytest.raises(ValueError):
        LossSettings(kind="ppo", dual_clip=0.5)  # must be > 1
