"""The RL loss: hand-checked values, per-slot sums, non-finite isolation, normalisation."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from contracts.run_config import LossSettings, OptimSettings, SchedulerSettings
from trainer_core.loss import LossStats, compute_loss, rl_loss
from trainer_core.optim import MultiRunOptimizer

torch.set_num_threads(1)

LOG_HALF = math.log(0.5)


def _batch(**overrides):
    """One sample of 6 tokens over a 2-token vocabulary, uniform logits (logp = log 1/2).

    Token 0 is the prompt; tokens 1..5 are completion tokens.
    """
    T = 6
    batch = dict(
        input_ids=torch.tensor([0, 1, 0, 1, 0, 1]),
        loss_mask=torch.tensor([False, True, True, True, True, True]),
        advantages=torch.tensor([0.0, 1.0, 2.0, -1.0, 3.0, 0.5]),
        inference_logprobs=torch.full((T,), LOG_HALF),
        temperatures=torch.ones(T),
        token_slots=torch.zeros(T, dtype=torch.long),
        sample_ids=torch.zeros(T, dtype=torch.long),
    )
    batch.update(overrides)
    return batch


def _run(logits, batch, settings, n_slots=1):
    return compute_loss(logits, **batch, settings=settings, n_slots=n_slots)


def test_token_is_hand_checked_with_ratio_masking():
    logits = torch.zeros(6, 2, requires_grad=True)
    # Ratios of tokens 1..5: 2, 1, e^-3 (< 1/8, masked), e^3 (> 8, masked), 1/4.
    ilp = torch.tensor([0.0, math.log(0.25), LOG_HALF, LOG_HALF + 3, LOG_HALF - 3, math.log(2.0)])
    batch = _batch(inference_logprobs=ilp)
    out = _run(logits, batch, [LossSettings(kind="token_is", mask_ratio_low=0.125, mask_ratio_high=8.0)])

    expected = -(2.0 * 1.0) - (1.0 * 2.0) - (0.25 * 0.5)
    assert out.total.item() == pytest.approx(expected, rel=1e-6)
    s = out.stats.slot(0)
    assert s.loss_sum == pytest.approx(expected, rel=1e-6)
    assert s.loss_tokens == 3  # the tokens that carry loss: the normaliser
    assert s.masked_tokens == 2
    assert s.entropy_sum == pytest.approx(5 * math.log(2.0), rel=1e-6)
    ratios = [2.0, 1.0, math.exp(-3), math.exp(3), 0.25]
    assert s.mismatch_kl_sum == pytest.approx(sum(r - math.log(r) - 1 for r in ratios), rel=1e-5)
    assert not s.nonfinite

    out.total.backward()
    # d(-r A)/d logit_j = -A r (1[j = y] - 1/2) on the row that predicts the token.
    grad = torch.zeros(6, 2)
    for t, (r, a) in {1: (2.0, 1.0), 2: (1.0, 2.0), 5: (0.25, 0.5)}.items():
        y = int(batch["input_ids"][t])
        grad[t - 1] = torch.tensor([-a * r * ((j == y) - 0.5) for j in range(2)])
    torch.testing.assert_close(logits.grad, grad, rtol=1e-6, atol=1e-7)  # masked rows: exactly 0
    assert logits.grad[2].abs().sum() == 0 and logits.grad[3].abs().sum() == 0


def test_sequence_is_masks_whole_samples_by_geometric_mean():
    # Two samples of 3 tokens: [prompt, c, c]. Sample 0's log ratios (log 16, log 1/4) have a
    # geometric mean of 2 (kept, although 16 alone is out of bounds); sample 1's (log 16, log 16)
    # mean 16 (> 8: the whole sample is masked, the in-bounds ... none here).
    ids = torch.tensor([0, 1, 1, 0, 1, 1])
    ilp = torch.tensor(
        [0.0, LOG_HALF - math.log(16), LOG_HALF + math.log(4), 0.0, *([LOG_HALF - math.log(16)] * 2)]
    )
    batch = _batch(
        input_ids=ids,
        inference_logprobs=ilp,
        loss_mask=torch.tensor([False, True, True, False, True, True]),
        sample_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        advantages=torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0]),
    )
    logits = torch.zeros(6, 2, requires_grad=True)
    seq = _run(logits, batch, [LossSettings(kind="sequence_is")])
    assert seq.total.item() == pytest.approx(-(16.0 + 0.25), rel=1e-6)
    assert seq.stats.slot(0).masked_tokens == 2
    seq.total.backward()
    assert logits.grad[3:].abs().sum() == 0  # rows predicting sample 1's tokens (and its prompt)

    tok = _run(torch.zeros(6, 2), batch, [LossSettings(kind="token_is")])
    assert tok.total.item() == pytest.approx(-0.25, rel=1e-6)  # only the 1/4 token survives
    assert tok.stats.slot(0).masked_tokens == 3


def test_kl_penalty_and_temperature():
    # Token 1 (id 0) predicted from logits [2, 0] at temperature 2 -> [1, 0].
    logits = torch.zeros(6, 2)
    logits[0] = torch.tensor([2.0, 0.0])
    temps = torch.full((6,), 2.0)
    logp = 1.0 - math.log(1.0 + math.e)
    ilp = torch.full((6,), LOG_HALF)
    ilp[1] = logp - math.log(2.0)  # ratio 2 at token 1; 1 elsewhere
    batch = _batch(
        input_ids=torch.tensor([0, 0, 0, 0, 0, 0]),
        temperatures=temps,
        inference_logprobs=ilp,
        loss_mask=torch.tensor([False, True, False, False, False, False]),
    )
    out = _run(logits, batch, [LossSettings(kl_coef=0.5)])
    k3 = 2.0 - math.log(2.0) - 1.0
    assert out.total.item() == pytest.approx(-2.0 * 1.0 + 0.5 * k3, rel=1e-6)
    assert out.stats.slot(0).mismatch_kl_sum == pytest.approx(k3, rel=1e-5)


def test_per_slot_sums_and_ignored_tokens():
    # Slot 0: sample 0 (tokens 0-2); slot 2: sample 1 (tokens 3-5); then padding.
    ids = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0])
    batch = dict(
        input_ids=ids,
        # Token 3 opens sample 1: its mask is wrongly set and must be ignored (it would read
        # sample 0's logits); padding tokens are ignored whatever their mask says.
        loss_mask=torch.tensor([False, True, True, True, True, True, True, True]),
        advantages=torch.tensor([0.0, 1.0, 2.0, 9.0, 3.0, 4.0, 5.0, 5.0]),
        inference_logprobs=torch.full((8,), LOG_HALF),
        temperatures=torch.ones(8),
        token_slots=torch.tensor([0, 0, 0, 2, 2, 2, 2, 2]),
        sample_ids=torch.tensor([0, 0, 0, 1, 1, 1, -1, -1]),
    )
    row = SimpleNamespace(**batch)  # what rl_loss reads of a packing.MicroBatch
    out = rl_loss(torch.zeros(8, 2), row, slot_settings={0: LossSettings(), 2: LossSettings()}, n_slots=3)
    assert sorted(out.per_slot) == [0, 2] and out.per_slot[2].loss_sum == pytest.approx(-7.0)
    assert out.stats.loss_tokens.tolist() == [2, 0, 2]
    torch.testing.assert_close(out.stats.loss_sum, torch.tensor([-3.0, 0.0, -7.0], dtype=torch.float64))
    assert out.total.item() == pytest.approx(-10.0)
    assert not out.stats.nonfinite.any()

    # Accumulation and the packed all-reduce layout.
    both = out.stats + out.stats
    assert both.loss_tokens.tolist() == [4, 0, 4]
    back = LossStats.from_tensor(both.to_tensor())
    assert back.loss_tokens.tolist() == [4, 0, 4] and back.loss_sum.tolist() == both.loss_sum.tolist()

    with pytest.raises(ValueError, match="no LossSettings"):
        compute_loss(torch.zeros(8, 2), **batch, settings={0: LossSettings()}, n_slots=3)


def _two_slot_batch(gen):
    """Random logits over V=7 for 3 samples: slot 0 owns samples 0 and 1, slot 1 owns sample 2."""
    T, V = 12, 7
    logits = torch.randn(T, V, generator=gen)
    batch = dict(
        input_ids=torch.randint(0, V, (T,), generator=gen),
        loss_mask=torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool),
        advantages=torch.randn(T, generator=gen),
        inference_logprobs=-torch.rand(T, generator=gen) * 3,
        temperatures=torch.tensor([0.7] * 7 + [1.3] * 5),
        token_slots=torch.tensor([0] * 7 + [1] * 5),
        sample_ids=torch.tensor([0] * 4 + [1] * 3 + [2] * 5),
    )
    return logits, batch


def _poison_logits(logits, batch):
    logits[9, 3] = float("nan")


def _poison_adv(logits, batch):
    batch["advantages"][10] = float("nan")


def _poison_ilp(logits, batch):
    batch["inference_logprobs"][8] = float("-inf")


def _poison_temp(logits, batch):
    batch["temperatures"][8:] = 0.0


def _poison_overflow(logits, batch):
    # Finite inputs whose loss overflows (ratio 2 times an advantage of 3e38): found after
    # the forward, still exactly isolated.
    logp = torch.log_softmax(logits[7:11] / batch["temperatures"][8:, None], dim=-1)
    batch["inference_logprobs"][8:] = logp.gather(1, batch["input_ids"][8:, None]).squeeze(1) - math.log(2.0)
    batch["advantages"][8:] = 3e38


@pytest.mark.parametrize("poison", [_poison_logits, _poison_adv, _poison_ilp, _poison_temp, _poison_overflow])
def test_nonfinite_slot_leaves_other_slots_gradients_bit_identical(poison):
    settings = [
        LossSettings(kl_coef=0.1, mask_ratio_high=1000.0),
        LossSettings(kl_coef=0.1, mask_ratio_high=1000.0),
    ]
    logits, batch = _two_slot_batch(torch.Generator().manual_seed(0))
    clean_logits = logits.clone().requires_grad_(True)
    clean = compute_loss(clean_logits, **batch, settings=settings, n_slots=2)
    clean.total.backward()

    poison(logits, batch)
    bad_logits = logits.clone().requires_grad_(True)
    bad = compute_loss(bad_logits, **batch, settings=settings, n_slots=2)
    bad.total.backward()

    assert bad.stats.nonfinite.tolist() == [False, True]
    assert torch.isfinite(bad.total)
    assert bad.total.item() == pytest.approx(clean.stats.loss_sum[0].item(), rel=1e-6)
    # Slot 0's rows (0..6) are bit-identical; slot 1's rows get an exact zero, not NaN.
    assert torch.equal(bad_logits.grad[:7], clean_logits.grad[:7])
    assert torch.equal(bad_logits.grad[7:], torch.zeros_like(bad_logits.grad[7:]))
    assert bad.stats.loss_sum[0] == clean.stats.loss_sum[0]
    assert bad.stats.loss_sum[1] == 0
    assert bad.stats.loss_tokens[0] == clean.stats.loss_tokens[0]
    assert bad.per_slot[1].nonfinite and not bad.per_slot[0].nonfinite


class _TinyPolicy(torch.nn.Module):
    """logits[t] = E[ids[t]] @ W[slot[t]]: a frozen embedding and one head per slot, so that
    each run has parameters of its own, like a LoRA slot."""

    def __init__(self, vocab: int = 11, dim: int = 5, n_slots: int = 2) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.register_buffer("emb", torch.randn(vocab, dim, generator=gen))
        self.heads = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(dim, vocab, generator=gen) * 0.3) for _ in range(n_slots)
        )

    def forward(self, ids, slots):
        w = torch.stack(list(self.heads))[slots]  # (T, dim, vocab)
        return torch.einsum("td,tdv->tv", self.emb[ids], w)


def _sample(gen, n: int, vocab: int = 11):
    ids = torch.randint(0, vocab, (n,), generator=gen)
    mask = torch.ones(n, dtype=torch.bool)
    mask[: n // 2] = False
    return dict(
        input_ids=ids,
        loss_mask=mask,
        advantages=torch.full((n,), float(torch.randn((), generator=gen))),
        inference_logprobs=-torch.rand(n, generator=gen) * 2 - 1.5,
        temperatures=torch.full((n,), 0.9),
    )


def _pack(samples):
    """Concatenate (slot, sample) pairs into one packed row."""
    keys = samples[0][1].keys()
    row = {k: torch.cat([s[k] for _, s in samples]) for k in keys}
    row["token_slots"] = torch.cat([torch.full((len(s["input_ids"]),), slot) for slot, s in samples])
    row["sample_ids"] = torch.cat([torch.full((len(s["input_ids"]),), i) for i, (_, s) in enumerate(samples)])
    return row


def test_normalised_gradient_equals_mean_loss_gradient_for_any_split():
    """A's gradient after MultiRunOptimizer normalisation == grad of A's mean loss over its
    tokens, however A's samples are split over micro-batches and whatever shares them."""
    settings = [LossSettings(), LossSettings()]
    gen = torch.Generator().manual_seed(3)
    a_samples = [_sample(gen, n) for n in (6, 9, 4, 7)]
    b_samples = [_sample(gen, n) for n in (5, 8)]

    ref_model = _TinyPolicy()
    row = _pack([(0, s) for s in a_samples])
    out = compute_loss(ref_model(row["input_ids"], row["token_slots"]), **row, settings=settings, n_slots=2)
    n_tokens = int(out.stats.loss_tokens[0])
    (out.total / n_tokens).backward()
    ref = [ref_model.heads[0].grad.clone()]

    captured: list[list[torch.Tensor]] = []

    def capture(optimizer, args, kwargs):
        captured.append([p.grad.clone() for p in optimizer.param_groups[0]["params"]])

    splits = [
        [
            [(0, a_samples[0]), (1, b_samples[0])],
            [(0, a_samples[1]), (0, a_samples[2]), (1, b_samples[1])],
            [(0, a_samples[3])],
        ],
        [
            [(1, b_samples[0]), (0, a_samples[3]), (0, a_samples[0])],
            [(1, b_samples[1])],
            [(0, a_samples[2]), (0, a_samples[1])],
        ],
    ]
    handle = register_optimizer_step_pre_hook(capture)
    try:
        for micro_batches in splits:
            model = _TinyPolicy()
            opt = MultiRunOptimizer(n_slots=2)

            opt.create(
                0,
                [model.heads[0]],
                optim=OptimSettings(max_grad_norm=1e6),
                scheduler=SchedulerSettings(),
                max_steps=10,
            )
            for mb in micro_batches:
                row = _pack(mb)
                out = compute_loss(
                    model(row["input_ids"], row["token_slots"]), **row, settings=settings, n_slots=2
                )
                out.total.backward()
                opt.add_loss_tokens(0, out.stats.loss_tokens[0])
            captured.clear()
            stats = opt.step([0])[0]
            assert stats.loss_tokens == n_tokens
            assert len(captured) == 1
            for got, want in zip(captured[0], ref, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref]))
            assert stats.grad_norm == pytest.approx(float(norm), rel=1e-5)
    finally:
        handle.remove()
