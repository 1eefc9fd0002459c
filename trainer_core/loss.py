"""The RL loss over one packed micro-batch, kept per run (slot).

Estimator (per completion token t of a run, with ``r_t = exp(logp_t - logp_inf_t)``,
``logp_t`` the trainer's logprob of token t from temperature-scaled logits, ``A_t`` the
advantage):

    loss_t = -r_t * A_t + kl_coef * (r_t - log r_t - 1)

``r_t`` carries the gradient, so ``grad loss_t = -A_t * r_t * grad logp_t`` (the
token-level importance-sampled policy gradient; ``r_t`` corrects for the inference
engine having sampled from a slightly different policy). The second term is the k3
estimator of ``KL(pi_inf || pi_theta)``; with samples from ``pi_inf`` its gradient
``(r_t - 1) grad logp_t`` is unbiased for that KL, and it is zero when the two policies
agree.

Masking: a token whose ratio leaves ``[mask_ratio_low, mask_ratio_high]`` contributes
nothing (no loss, no gradient) under ``kind="token_is"``; under ``kind="sequence_is"``
a whole sample is masked when its geometric-mean ratio ``exp(mean_t log r_t)`` leaves
the bounds, and the tokens of a kept sample are not masked one by one.

``loss_tokens`` counts the tokens that carry loss: loss-mask tokens that were not
ratio-masked. It is the run's normaliser, so a run's loss is the mean over the tokens
it actually trains on; ``masked_tokens`` counts the ratio-masked ones, so the masked
fraction is ``masked / (loss_tokens + masked)``.

Normalisation is NOT done here. ``LossResult.total`` is the sum over slots of each
slot's loss SUM; the optimizer divides a run's gradient by that run's loss tokens over
its whole step (all micro-batches, all ranks) — DESIGN §4.1 — so that a run's update
does not depend on what it was packed with.

Non-finite values: a slot whose inputs (logits rows, advantages, inference logprobs,
temperatures) or per-token loss are non-finite is reported (``nonfinite``) and its
tokens are replaced by constants with ``torch.where`` *before* any differentiable
operation that could turn a zero gradient into NaN (``0 * inf``). Its tokens therefore
receive an exactly zero gradient, and nothing of it can reach another slot — not even
through a dense attention backward, where ``0 * NaN`` would leak across samples.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from contracts.run_config import LossSettings


class MicroBatchLike(Protocol):
    """The tensor attributes of ``trainer_core.packing.MicroBatch`` that the loss reads, each (T,)."""

    input_ids: Tensor
    loss_mask: Tensor
    advantages: Tensor
    inference_logprobs: Tensor
    temperatures: Tensor
    token_slots: Tensor
    sample_ids: Tensor


@dataclass
class SlotLossStats:
    """One slot's loss statistics as Python numbers (sums; the caller averages)."""

    loss_sum: float
    """Sum of the per-token loss over the slot's loss tokens (0 for masked tokens)."""
    loss_tokens: int
    """Tokens that carry loss: loss-mask tokens not ratio-masked (the normaliser)."""
    entropy_sum: float
    """Sum of the trainer policy's entropy (nats) at the slot's loss tokens."""
    mismatch_kl_sum: float
    """Sum of the k3 estimate of KL(inference || trainer) over the slot's loss tokens."""
    masked_tokens: int
    """Loss tokens whose importance ratio (token or sequence) left the bounds."""
    nonfinite: bool
    """NaN/Inf appeared in the slot's inputs or loss; its tokens were left out of ``total``."""


@dataclass
class LossStats:
    """Per-slot statistics of one micro-batch, each a tensor of shape (n_slots,).

    Tensors rather than Python numbers so that accumulating over micro-batches and
    all-reducing over ranks needs no host synchronisation until the caller asks.
    """

    loss_sum: Tensor
    """(n_slots,) float64: sum of per-token losses (0 for masked tokens and non-finite slots)."""
    loss_tokens: Tensor
    """(n_slots,) int64: tokens that carry loss (loss-mask tokens not ratio-masked): the normaliser."""
    entropy_sum: Tensor
    """(n_slots,) float64: sum of trainer-policy entropy at loss tokens."""
    mismatch_kl_sum: Tensor
    """(n_slots,) float64: sum of k3 KL(inference || trainer) at loss tokens."""
    masked_tokens: Tensor
    """(n_slots,) int64: ratio-masked loss tokens."""
    nonfinite: Tensor
    """(n_slots,) bool: NaN/Inf appeared in that slot."""

    def __add__(self, other: "LossStats") -> "LossStats":
        """Accumulate over micro-batches (sums add, ``nonfinite`` ORs)."""
        return LossStats(
            loss_sum=self.loss_sum + other.loss_sum,
            loss_tokens=self.loss_tokens + other.loss_tokens,
            entropy_sum=self.entropy_sum + other.entropy_sum,
            mismatch_kl_sum=self.mismatch_kl_sum + other.mismatch_kl_sum,
            masked_tokens=self.masked_tokens + other.masked_tokens,
            nonfinite=self.nonfinite | other.nonfinite,
        )

    def to_tensor(self) -> Tensor:
        """(6, n_slots) float64, for a single SUM all-reduce across ranks.

        Counts stay exact in float64 below 2**53; ``nonfinite`` sums to a positive count.
        """
        return torch.stack(
            [
                self.loss_sum,
                self.loss_tokens.double(),
                self.entropy_sum,
                self.mismatch_kl_sum,
                self.masked_tokens.double(),
                self.nonfinite.double(),
            ]
        )

    @classmethod
    def from_tensor(cls, packed: Tensor) -> "LossStats":
        """Inverse of ``to_tensor`` (after a SUM all-reduce)."""
        return cls(
            loss_sum=packed[0],
            loss_tokens=packed[1].round().long(),
            entropy_sum=packed[2],
            mismatch_kl_sum=packed[3],
            masked_tokens=packed[4].round().long(),
            nonfinite=packed[5] > 0,
        )

    @classmethod
    def zeros(cls, n_slots: int, device: torch.device | str | None = None) -> "LossStats":
        f = torch.zeros(n_slots, dtype=torch.float64, device=device)
        i = torch.zeros(n_slots, dtype=torch.long, device=device)
        return cls(
            f, i, f.clone(), f.clone(), i.clone(), torch.zeros(n_slots, dtype=torch.bool, device=device)
        )

    def only(self, slot: int) -> "LossStats":
        """These statistics with every slot but ``slot`` zeroed."""
        keep = torch.zeros_like(self.nonfinite)
        keep[slot] = True
        return LossStats(
            loss_sum=torch.where(keep, self.loss_sum, 0.0),
            loss_tokens=torch.where(keep, self.loss_tokens, 0),
            entropy_sum=torch.where(keep, self.entropy_sum, 0.0),
            mismatch_kl_sum=torch.where(keep, self.mismatch_kl_sum, 0.0),
            masked_tokens=torch.where(keep, self.masked_tokens, 0),
            nonfinite=self.nonfinite & keep,
        )

    def flag_nonfinite(self, slot: int) -> "LossStats":
        """These statistics with ``slot`` marked non-finite (its gradients overflowed)."""
        nonfinite = self.nonfinite.clone()
        nonfinite[slot] = True
        return LossStats(
            self.loss_sum,
            self.loss_tokens,
            self.entropy_sum,
            self.mismatch_kl_sum,
            self.masked_tokens,
            nonfinite,
        )

    def slot(self, slot: int) -> SlotLossStats:
        """One slot's numbers (synchronises with the device)."""
        return SlotLossStats(
            loss_sum=float(self.loss_sum[slot]),
            loss_tokens=int(self.loss_tokens[slot]),
            entropy_sum=float(self.entropy_sum[slot]),
            mismatch_kl_sum=float(self.mismatch_kl_sum[slot]),
            masked_tokens=int(self.masked_tokens[slot]),
            nonfinite=bool(self.nonfinite[slot]),
        )


@dataclass
class LossResult:
    total: Tensor
    """Scalar to call ``backward`` on: the sum over slots of per-slot loss SUMS (not normalised)."""
    stats: LossStats
    """Per-slot sums and counts of this micro-batch."""

    @property
    def per_slot(self) -> dict[int, SlotLossStats]:
        """Python numbers for every slot that had loss-mask tokens or went non-finite
        (synchronises with the device)."""
        present = (self.stats.loss_tokens + self.stats.masked_tokens > 0) | self.stats.nonfinite
        return {int(i): self.stats.slot(int(i)) for i in present.nonzero().flatten().tolist()}


def _settings_table(
    settings: Mapping[int, LossSettings] | Sequence[LossSettings | None],
    n_slots: int,
    device: torch.device,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-slot (n_slots,) tensors: log low, log high, kl_coef, is-sequence, has-settings."""
    default = LossSettings()
    log_low, log_high, kl, seq, known = [], [], [], [], []
    for s in range(n_slots):
        cfg = (
            settings.get(s) if isinstance(settings, Mapping) else (settings[s] if s < len(settings) else None)
        )
        known.append(cfg is not None)
        cfg = cfg or default
        log_low.append(math.log(cfg.mask_ratio_low))
        log_high.append(math.log(cfg.mask_ratio_high))
        kl.append(cfg.kl_coef)
        seq.append(cfg.kind == "sequence_is")

    def t(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return (
        t(log_low, torch.float32),
        t(log_high, torch.float32),
        t(kl, torch.float32),
        t(seq, torch.bool),
        t(known, torch.bool),
    )


def _per_slot_sum(slots: Tensor, values: Tensor, n_slots: int, dtype: torch.dtype) -> Tensor:
    """(n_slots,) sums of ``values`` (N,) grouped by ``slots`` (N,)."""
    out = torch.zeros(n_slots, dtype=dtype, device=slots.device)
    return out.index_add_(0, slots, values.to(dtype))


def compute_loss(
    logits: Tensor,
    *,
    input_ids: Tensor,
    loss_mask: Tensor,
    advantages: Tensor,
    inference_logprobs: Tensor,
    temperatures: Tensor,
    token_slots: Tensor,
    sample_ids: Tensor,
    settings: Mapping[int, LossSettings] | Sequence[LossSettings | None],
    n_slots: int,
) -> LossResult:
    """The RL loss of one packed micro-batch of T tokens, summed per slot.

    Args:
        logits: (T, V) the model's logits for the packed row; ``logits[t-1]`` predicts token t.
        input_ids: (T,) token ids.
        loss_mask: (T,) bool, token t is a completion token that carries loss.
        advantages: (T,) advantage of token t.
        inference_logprobs: (T,) logprob of token t under the inference policy.
        temperatures: (T,) sampling temperature of token t's sample (divides ``logits[t-1]``).
        token_slots: (T,) long, the slot of token t.
        sample_ids: (T,) long, sample index within the micro-batch; -1 for padding.
        settings: each slot's LossSettings (a mapping slot -> settings, or a list indexed by slot);
            every slot with loss tokens must have one.
        n_slots: number of slots (size of the per-slot statistics).

    A token only carries loss if its predecessor belongs to the same sample, so a
    mask that wrongly marks the first token of a sample cannot read the previous
    sample's logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (T, V), got {tuple(logits.shape)}")
    device = logits.device
    log_low, log_high, kl_coef, is_seq, known = _settings_table(settings, n_slots, device)

    # Positions p of the logits rows that predict a loss token p + 1.
    same_sample = (sample_ids[1:] == sample_ids[:-1]) & (sample_ids[1:] >= 0)  # (T-1,)
    pos = (loss_mask[1:].bool() & same_sample).nonzero().squeeze(1)  # (N,)
    tok = pos + 1  # (N,)
    slots = token_slots[tok]  # (N,)
    sids = sample_ids[tok]  # (N,)

    mask_tokens = torch.bincount(slots, minlength=n_slots)  # (n_slots,)
    unknown = (mask_tokens > 0) & ~known
    if bool(unknown.any()):
        raise ValueError(
            f"no LossSettings for slots {unknown.nonzero().flatten().tolist()} that have loss tokens"
        )

    adv = advantages[tok].float()  # (N,)
    ilp = inference_logprobs[tok].float()  # (N,)
    temp = temperatures[tok].float()  # (N,)
    temp_ok = torch.isfinite(temp) & (temp > 0)
    # A bad temperature must not be divided by even for a zero gradient (0 / 0 = NaN).
    temp = torch.where(temp_ok, temp, torch.ones_like(temp))

    # fp32 for the log-softmax whatever the model's dtype: logprob differences feed exp().
    scaled = logits.index_select(0, pos).float() / temp[:, None]  # (N, V)

    # Stage 1: non-finite inputs flag their slot; the slot's rows become constants before
    # anything differentiable touches them, so their gradient is exactly zero.
    tok_ok = temp_ok & torch.isfinite(adv) & torch.isfinite(ilp) & torch.isfinite(scaled.detach()).all(dim=-1)
    slot_bad = _per_slot_sum(slots, ~tok_ok, n_slots, torch.long) > 0  # (n_slots,)
    tok_bad = slot_bad[slots]  # (N,)
    scaled = torch.where(tok_bad[:, None], torch.zeros((), device=device), scaled)
    adv = torch.where(tok_bad, 0.0, adv)
    ilp = torch.where(tok_bad, 0.0, ilp)

    logp_all = F.log_softmax(scaled, dim=-1)  # (N, V)
    logp = logp_all.gather(1, input_ids[tok].long()[:, None]).squeeze(1)  # (N,)
    log_ratio = logp - ilp  # (N,)

    with torch.no_grad():
        lr = log_ratio.detach()
        tok_low, tok_high = log_low[slots], log_high[slots]
        tok_masked = (lr < tok_low) | (lr > tok_high)
        # Geometric-mean sequence ratio: mean log ratio over the sample's loss tokens. The
        # packer never splits a sample across rows, so the row holds all of them; sample
        # ids are < T, so T buckets always suffice.
        n_buckets = input_ids.shape[0]
        seq_sum = torch.zeros(n_buckets, dtype=torch.float32, device=device).index_add_(0, sids, lr)
        seq_cnt = torch.zeros(n_buckets, dtype=torch.float32, device=device).index_add_(
            0, sids, torch.ones_like(lr)
        )
        seq_lr = (seq_sum / seq_cnt.clamp_min(1.0))[sids]  # (N,)
        seq_masked = (seq_lr < tok_low) | (seq_lr > tok_high)
        masked = torch.where(is_seq[slots], seq_masked, tok_masked) & ~tok_bad
        keep = ~masked & ~tok_bad

        # Stage 2: a loss that is still non-finite (e.g. an overflowing ratio or advantage)
        # flags its slot too; found on detached values so that the differentiable pass
        # below never evaluates it.
        tok_kl = kl_coef[slots]
        kept_lr = torch.where(keep, lr, 0.0)
        probe = -torch.exp(kept_lr) * adv + tok_kl * (torch.exp(kept_lr) - kept_lr - 1.0)
        late_bad = keep & ~torch.isfinite(probe)
        slot_bad |= _per_slot_sum(slots, late_bad, n_slots, torch.long) > 0
        tok_bad = slot_bad[slots]
        keep &= ~tok_bad
        masked &= ~tok_bad

        entropy = -(logp_all.detach().exp() * logp_all.detach()).sum(dim=-1)  # (N,)
        mismatch_kl = torch.exp(lr) - lr - 1.0  # (N,) k3 of KL(inference || trainer)
        # where(), not a product: a metric of a bad slot may be NaN and NaN * 0 is NaN.
        entropy = torch.where(tok_bad, 0.0, entropy)
        mismatch_kl = torch.where(tok_bad, 0.0, mismatch_kl)

    # Masked and bad tokens: ratio exactly 1 and advantage 0 by construction, and the
    # where() hands them a zero gradient without multiplying through exp().
    safe_lr = torch.where(keep, log_ratio, torch.zeros((), device=device))
    ratio = torch.exp(safe_lr)  # (N,)
    per_token = -ratio * torch.where(keep, adv, 0.0) + tok_kl * (ratio - safe_lr - 1.0)
    per_token = torch.where(keep, per_token, torch.zeros((), device=device))  # (N,)
    total = per_token.sum()

    masked_tokens = _per_slot_sum(slots, masked, n_slots, torch.long)
    stats = LossStats(
        loss_sum=_per_slot_sum(slots, per_token.detach(), n_slots, torch.float64),
        loss_tokens=mask_tokens - masked_tokens,
        entropy_sum=_per_slot_sum(slots, entropy, n_slots, torch.float64),
        mismatch_kl_sum=_per_slot_sum(slots, mismatch_kl, n_slots, torch.float64),
        masked_tokens=masked_tokens,
        nonfinite=slot_bad,
    )
    return LossResult(total=total, stats=stats)


def rl_loss(
    logits: Tensor,
    micro_batch: MicroBatchLike,
    *,
    slot_settings: Mapping[int, LossSettings] | Sequence[LossSettings | None],
    n_slots: int,
) -> LossResult:
    """``compute_loss`` on a packed row (``trainer_core.packing.MicroBatch`` or anything with
    the same tensor attributes); the row's tensors are moved to the logits' device."""
    device = logits.device
    return compute_loss(
        logits,
        input_ids=micro_batch.input_ids.to(device),
        loss_mask=micro_batch.loss_mask.to(device),
        advantages=micro_batch.advantages.to(device),
        inference_logprobs=micro_batch.inference_logprobs.to(device),
        temperatures=micro_batch.temperatures.to(device),
        token_slots=micro_batch.token_slots.to(device),
        sample_ids=micro_batch.sample_ids.to(device),
        settings=slot_settings,
        n_slots=n_slots,
    )
