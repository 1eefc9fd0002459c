"""The losses over one packed micro-batch, kept per run (slot): every run picks its own
``config.loss.kind`` and runs of different kinds train in the same packed passes.

Notation, per loss token t of a run: ``logp_t`` the trainer's logprob of token t from
temperature-scaled logits, ``logp_inf_t`` the inference (sampler) logprob, ``r_t = exp(logp_t -
logp_inf_t)`` the importance ratio, ``A_t`` the advantage, ``w_t`` the token's weight, ``sg`` a
stop-gradient, ``clip(x) = min(max(x, 1 - clip_low), 1 + clip_high)``.

Policy terms (``pg_t``) by kind (`trainer_core.policy_terms`, shared with the Tinker losses):

    token_is / sequence_is   pg_t = -r_t * A_t                      (ratio masking, below)
    ppo                      pg_t = max(-r_t * A_t, -clip(r_t) * A_t)
                             with dual_clip c and A_t < 0:  pg_t = min(pg_t, -c * A_t)
    cispo                    pg_t = -sg(clip(r_t)) * A_t * logp_t    (MiniMax-M1's CISPO)
    cross_entropy            pg_t = -w_t * logp_t                    (SFT; w_t = `weights` or the loss mask;
                                                                      logp_t at temperature 1)

``r_t`` carries the gradient in token_is/sequence_is/ppo, so their gradient is ``-A_t r_t grad logp_t``
where the ratio is not clipped (ppo: zero once the clip binds in the direction of the advantage). In
cispo the clipped ratio is a constant coefficient, so every token keeps a gradient ``-sg(clip(r_t)) A_t
grad logp_t`` (clipping bounds it; it never drops the token).

Added for every RL kind (not cross_entropy):

    kl_coef * (r_t - log r_t - 1)                 k3 estimate of KL(pi_inf || pi_theta)
    kl_ref_coef * k(d_t),  d_t = logp_ref_t - logp_t
        k1: -d_t     k2: d_t**2 / 2     k3: exp(d_t) - d_t - 1           (KL(pi_theta || pi_ref))
    -entropy_coef * H_t,   H_t = -sum_v p_v log p_v of the trainer's (temperature-scaled) distribution
    value_coef * huber(V_t - R_t; value_clip)     runs with advantage.estimator = "gae" (trainer_core.critic)

``logp_ref_t`` is the logprob of the reference policy = the frozen base model WITHOUT any adapter, from
one extra no-grad forward of the micro-batch shared by every run in it that asks for it
(`trainer_core.step`), scaled by the same temperature as ``logp_t``. The KL estimators are those of
Schulman's "Approximating KL divergence" with samples from the policy; all are zero when the policies
agree, and k3 is non-negative.

Ratio masking (token_is / sequence_is only): a token whose ratio leaves ``[mask_ratio_low,
mask_ratio_high]`` contributes nothing (no loss, no gradient) under ``kind="token_is"``; under
``kind="sequence_is"`` a whole sample is masked when its geometric-mean ratio ``exp(mean_t log r_t)``
leaves the bounds, and the tokens of a kept sample are not masked one by one.

``loss_tokens`` counts the tokens that carry loss: loss-mask tokens that were not ratio-masked;
``masked_tokens`` counts the ratio-masked ones, so the masked fraction is ``masked / (loss_tokens +
masked)``. ``normaliser`` is what the run's gradient is divided by: the sum of ``w_t`` over its loss
tokens for cross_entropy (so SFT is the weighted mean cross-entropy), ``loss_tokens`` otherwise.

Normalisation is NOT done here. ``LossResult.total`` is the sum over slots of each slot's loss SUM; the
optimizer divides a run's gradient by that run's normaliser over its whole step (all micro-batches, all
ranks) — DESIGN §4.1 — so that a run's update does not depend on what it was packed with.

Non-finite values: a slot whose inputs (logits rows, advantages, inference or reference logprobs,
temperatures, weights, rewards, values) or per-token loss are non-finite is reported (``nonfinite``)
and its tokens are replaced by constants with ``torch.where`` *before* any differentiable operation
that could turn a zero gradient into NaN (``0 * inf``). Its tokens therefore receive an exactly zero
gradient, and nothing of it can reach another slot — not even through a dense attention backward,
where ``0 * NaN`` would leak across samples.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from contracts.run_config import AdvantageSettings, LossSettings
from trainer_core.critic import gae_advantages, value_loss
from trainer_core.policy_terms import cispo_term, cross_entropy_term, importance_sampling_term, ppo_term

_KINDS = ("token_is", "sequence_is", "cross_entropy", "ppo", "cispo")
_TOKEN_IS, _SEQUENCE_IS, _CROSS_ENTROPY, _PPO, _CISPO = range(len(_KINDS))
_ESTIMATORS = ("k1", "k2", "k3")


class MicroBatchLike(Protocol):
    """The tensor attributes of ``trainer_core.packing.MicroBatch`` that the loss reads, each (T,).

    Read-only: a compact row expands several of them on first use (cached properties)."""

    @property
    def input_ids(self) -> Tensor: ...
    @property
    def loss_mask(self) -> Tensor: ...
    @property
    def advantages(self) -> Tensor: ...
    @property
    def inference_logprobs(self) -> Tensor: ...
    @property
    def temperatures(self) -> Tensor: ...
    @property
    def token_slots(self) -> Tensor: ...
    @property
    def sample_ids(self) -> Tensor: ...
    @property
    def weights(self) -> Tensor | None: ...
    @property
    def rewards(self) -> Tensor | None: ...


@dataclass
class SlotLossStats:
    """One slot's loss statistics as Python numbers (sums; the caller averages)."""

    loss_sum: float
    """Sum of the per-token loss over the slot's loss tokens (0 for masked tokens)."""
    loss_tokens: int
    """Tokens that carry loss: loss-mask tokens not ratio-masked."""
    entropy_sum: float
    """Sum of the trainer policy's entropy (nats) at the slot's loss tokens."""
    mismatch_kl_sum: float
    """Sum of the k3 estimate of KL(inference || trainer) over the slot's loss tokens."""
    masked_tokens: int
    """Loss tokens whose importance ratio (token or sequence) left the bounds."""
    nonfinite: bool
    """NaN/Inf appeared in the slot's inputs or loss; its tokens were left out of ``total``."""
    normaliser: float = 0.0
    """What the run's gradient is divided by: sum of weights (cross_entropy) or ``loss_tokens``."""
    value_loss_sum: float = 0.0
    """Sum of the (unweighted) value loss over the slot's loss tokens (GAE runs; else 0)."""


_FIELDS = ("loss_sum", "loss_tokens", "entropy_sum", "mismatch_kl_sum", "masked_tokens", "nonfinite")


@dataclass
class LossStats:
    """Per-slot statistics of one micro-batch, each a tensor of shape (n_slots,).

    Tensors rather than Python numbers so that accumulating over micro-batches and
    all-reducing over ranks needs no host synchronisation until the caller asks.
    """

    loss_sum: Tensor
    """(n_slots,) float64: sum of per-token losses (0 for masked tokens and non-finite slots)."""
    loss_tokens: Tensor
    """(n_slots,) int64: tokens that carry loss (loss-mask tokens not ratio-masked)."""
    entropy_sum: Tensor
    """(n_slots,) float64: sum of trainer-policy entropy at loss tokens."""
    mismatch_kl_sum: Tensor
    """(n_slots,) float64: sum of k3 KL(inference || trainer) at loss tokens."""
    masked_tokens: Tensor
    """(n_slots,) int64: ratio-masked loss tokens."""
    nonfinite: Tensor
    """(n_slots,) bool: NaN/Inf appeared in that slot."""
    normaliser: Tensor | None = None
    """(n_slots,) float64: the gradient normaliser (sum of weights for cross_entropy, else loss tokens);
    None means ``loss_tokens``."""
    value_loss_sum: Tensor | None = None
    """(n_slots,) float64: sum of the value loss (GAE runs); None means zeros."""

    def __post_init__(self) -> None:
        if self.normaliser is None:
            self.normaliser = self.loss_tokens.double()
        if self.value_loss_sum is None:
            self.value_loss_sum = torch.zeros_like(self.loss_sum)

    @property
    def norm(self) -> Tensor:
        assert self.normaliser is not None  # set in __post_init__
        return self.normaliser

    @property
    def value_sum(self) -> Tensor:
        assert self.value_loss_sum is not None  # set in __post_init__
        return self.value_loss_sum

    def __add__(self, other: "LossStats") -> "LossStats":
        """Accumulate over micro-batches (sums add, ``nonfinite`` ORs)."""
        return LossStats(
            loss_sum=self.loss_sum + other.loss_sum,
            loss_tokens=self.loss_tokens + other.loss_tokens,
            entropy_sum=self.entropy_sum + other.entropy_sum,
            mismatch_kl_sum=self.mismatch_kl_sum + other.mismatch_kl_sum,
            masked_tokens=self.masked_tokens + other.masked_tokens,
            nonfinite=self.nonfinite | other.nonfinite,
            normaliser=self.norm + other.norm,
            value_loss_sum=self.value_sum + other.value_sum,
        )

    def to_tensor(self) -> Tensor:
        """(8, n_slots) float64, for a single SUM all-reduce across ranks.

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
                self.norm,
                self.value_sum,
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
            normaliser=packed[6],
            value_loss_sum=packed[7],
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
            normaliser=torch.where(keep, self.norm, 0.0),
            value_loss_sum=torch.where(keep, self.value_sum, 0.0),
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
            self.norm,
            self.value_sum,
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
            normaliser=float(self.norm[slot]),
            value_loss_sum=float(self.value_sum[slot]),
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


SettingsTable = Mapping[int, LossSettings] | Sequence[LossSettings | None]
AdvantageTable = Mapping[int, AdvantageSettings] | Sequence[AdvantageSettings | None]


def _lookup(table: Mapping | Sequence | None, slot: int) -> object | None:
    if table is None:
        return None
    if isinstance(table, Mapping):
        return table.get(slot)
    return table[slot] if slot < len(table) else None


@dataclass
class _SlotTable:
    """Per-slot settings as (n_slots,) tensors; index with a token's slot to get per-token values."""

    log_low: Tensor
    log_high: Tensor
    kl: Tensor
    kind: Tensor
    known: Tensor
    clip_low: Tensor
    clip_high: Tensor
    dual: Tensor
    """The dual clip c, +inf when none."""
    kl_ref: Tensor
    estimator: Tensor
    entropy: Tensor
    gae: Tensor
    gamma: Tensor
    lam: Tensor
    value_coef: Tensor
    value_clip: Tensor


def _settings_table(
    settings: SettingsTable, advantage: AdvantageTable | None, n_slots: int, device: torch.device
) -> _SlotTable:
    default, default_adv = LossSettings(), AdvantageSettings()
    rows: dict[str, list] = {name: [] for name in _SlotTable.__dataclass_fields__}
    for s in range(n_slots):
        cfg = _lookup(settings, s)
        adv = _lookup(advantage, s)
        assert cfg is None or isinstance(cfg, LossSettings)
        assert adv is None or isinstance(adv, AdvantageSettings)
        rows["known"].append(cfg is not None)
        cfg = cfg or default
        adv = adv or default_adv
        rows["log_low"].append(math.log(cfg.mask_ratio_low))
        rows["log_high"].append(math.log(cfg.mask_ratio_high))
        rows["kl"].append(cfg.kl_coef)
        rows["kind"].append(_KINDS.index(cfg.kind))
        rows["clip_low"].append(1.0 - cfg.clip_low)
        rows["clip_high"].append(1.0 + cfg.clip_high)
        rows["dual"].append(math.inf if cfg.dual_clip is None else cfg.dual_clip)
        rows["kl_ref"].append(cfg.kl_ref_coef)
        rows["estimator"].append(_ESTIMATORS.index(cfg.kl_ref_estimator))
        rows["entropy"].append(cfg.entropy_coef)
        rows["gae"].append(adv.estimator == "gae")
        rows["gamma"].append(adv.gamma)
        rows["lam"].append(adv.lam)
        rows["value_coef"].append(adv.value_coef)
        rows["value_clip"].append(adv.value_clip)
    dtypes = {"known": torch.bool, "gae": torch.bool, "kind": torch.long, "estimator": torch.long}
    return _SlotTable(
        **{
            name: torch.tensor(values, dtype=dtypes.get(name, torch.float32), device=device)
            for name, values in rows.items()
        }
    )


def _per_slot_sum(slots: Tensor, values: Tensor, n_slots: int, dtype: torch.dtype) -> Tensor:
    """(n_slots,) sums of ``values`` (N,) grouped by ``slots`` (N,)."""
    out = torch.zeros(n_slots, dtype=dtype, device=slots.device)
    return out.index_add_(0, slots, values.to(dtype))


def kl_estimate(d: Tensor, estimator: Tensor) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from ``d = logp_ref - logp`` (N,), by estimator
    code (N,) 0/1/2 = k1/k2/k3."""
    k1 = -d
    k2 = 0.5 * d * d
    k3 = torch.exp(d) - d - 1.0
    return torch.where(estimator == 0, k1, torch.where(estimator == 1, k2, k3))


@dataclass
class _TokenInputs:
    """What the per-token loss reads at the N loss positions (differentiable where noted)."""

    logp: Tensor
    """(N,) trainer logprob (differentiable)."""
    log_ratio: Tensor
    """(N,) logp - logp_inf, 0 where the ratio is not used (differentiable)."""
    adv: Tensor
    weight: Tensor
    ref_logp: Tensor
    entropy: Tensor
    """(N,) trainer entropy (differentiable when an entropy bonus is asked for)."""
    values: Tensor
    """(N,) value-head outputs (differentiable), 0 for runs without a critic."""
    returns: Tensor


def _token_losses(x: _TokenInputs, tab: _SlotTable, slots: Tensor) -> Tensor:
    """(N,) the per-token loss of every kind (the formulas of the module docstring), selected per token."""
    kind = tab.kind[slots]
    ratio = torch.exp(x.log_ratio)
    lo, hi = tab.clip_low[slots], tab.clip_high[slots]
    is_pg = importance_sampling_term(ratio, x.adv)
    ppo = ppo_term(ratio, x.adv, lo, hi)
    dual = tab.dual[slots]
    has_dual = torch.isfinite(dual)
    dual = torch.where(has_dual, dual, 0.0)  # inf * 0 would be NaN even in the branch not taken
    ppo = torch.where((x.adv < 0) & has_dual, torch.minimum(ppo, -dual * x.adv), ppo)
    cispo = cispo_term(ratio, x.adv, x.logp, lo, hi)
    ce = cross_entropy_term(x.logp, x.weight)
    pg = torch.where(kind == _PPO, ppo, torch.where(kind == _CISPO, cispo, is_pg))
    rl = (
        pg
        + tab.kl[slots] * (ratio - x.log_ratio - 1.0)
        + tab.kl_ref[slots] * kl_estimate(x.ref_logp - x.logp, tab.estimator[slots])
        - tab.entropy[slots] * x.entropy
        + tab.value_coef[slots] * value_loss(x.values, x.returns, tab.value_clip[slots]) * tab.gae[slots]
    )
    return torch.where(kind == _CROSS_ENTROPY, ce, rl)


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
    settings: SettingsTable,
    n_slots: int,
    weights: Tensor | None = None,
    ref_logits: Tensor | None = None,
    values: Tensor | None = None,
    rewards: Tensor | None = None,
    advantage_settings: AdvantageTable | None = None,
) -> LossResult:
    """The loss of one packed micro-batch of T tokens, summed per slot.

    Args:
        logits: (T, V) the model's logits for the packed row; ``logits[t-1]`` predicts token t.
        input_ids: (T,) token ids.
        loss_mask: (T,) bool, token t is a completion token that carries loss.
        advantages: (T,) advantage of token t (ignored by cross_entropy and GAE runs).
        inference_logprobs: (T,) logprob of token t under the inference policy.
        temperatures: (T,) sampling temperature of token t's sample (divides ``logits[t-1]``).
        token_slots: (T,) long, the slot of token t.
        sample_ids: (T,) long, sample index within the micro-batch; -1 for padding.
        settings: each slot's LossSettings (a mapping slot -> settings, or a list indexed by slot);
            every slot with loss tokens must have one.
        n_slots: number of slots (size of the per-slot statistics).
        weights: (T,) per-token weights of cross_entropy runs; None: the loss mask.
        ref_logits: (T, V) logits of the reference policy (base model, no adapter), no grad; needed
            when a slot with loss tokens has ``kl_ref_coef > 0``.
        values: (T,) value-head output at each position (``values[t-1]`` is token t's state);
            needed when a slot with loss tokens has ``advantage.estimator = "gae"``.
        rewards: (T,) per-token rewards of GAE runs; None: zeros.
        advantage_settings: each slot's AdvantageSettings (missing: "client").

    A token only carries loss if its predecessor belongs to the same sample, so a
    mask that wrongly marks the first token of a sample cannot read the previous
    sample's logits.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (T, V), got {tuple(logits.shape)}")
    device = logits.device
    tab = _settings_table(settings, advantage_settings, n_slots, device)

    # Positions p of the logits rows that predict a loss token p + 1.
    same_sample = (sample_ids[1:] == sample_ids[:-1]) & (sample_ids[1:] >= 0)  # (T-1,)
    pos = (loss_mask[1:].bool() & same_sample).nonzero().squeeze(1)  # (N,)
    tok = pos + 1  # (N,)
    slots = token_slots[tok]  # (N,)
    sids = sample_ids[tok]  # (N,)

    mask_tokens = torch.bincount(slots, minlength=n_slots)  # (n_slots,)
    present = mask_tokens > 0
    unknown = present & ~tab.known
    if bool(unknown.any()):
        raise ValueError(
            f"no LossSettings for slots {unknown.nonzero().flatten().tolist()} that have loss tokens"
        )
    needs_ref = bool((present & (tab.kl_ref > 0)).any())
    if needs_ref and ref_logits is None:
        raise ValueError("a slot with loss tokens has kl_ref_coef > 0 but no reference logits were given")
    needs_values = bool((present & tab.gae).any())
    if needs_values and values is None:
        raise ValueError("a slot with loss tokens uses GAE but no values were given")
    needs_entropy_grad = bool((present & (tab.entropy > 0)).any())
    kind = tab.kind[slots]  # (N,)
    is_ratio_masked_kind = (kind == _TOKEN_IS) | (kind == _SEQUENCE_IS)
    uses_ratio = kind != _CROSS_ENTROPY
    tok_gae = tab.gae[slots]

    adv = advantages[tok].float()  # (N,)
    ilp = inference_logprobs[tok].float()  # (N,)
    temp = temperatures[tok].float()  # (N,)
    weight = (weights[tok].float() if weights is not None else torch.ones_like(adv)) * (
        kind == _CROSS_ENTROPY
    )
    reward = rewards[tok].float() if rewards is not None else torch.zeros_like(adv)
    temp_ok = torch.isfinite(temp) & (temp > 0)
    # A bad temperature must not be divided by even for a zero gradient (0 / 0 = NaN).
    temp = torch.where(temp_ok, temp, torch.ones_like(temp))
    # SFT is the model's own cross-entropy: a batch's sampling temperature means nothing to it.
    temp = torch.where(kind == _CROSS_ENTROPY, torch.ones_like(temp), temp)

    # fp32 for the log-softmax whatever the model's dtype: logprob differences feed exp().
    scaled = logits.index_select(0, pos).float() / temp[:, None]  # (N, V)
    ref_scaled = (
        ref_logits.index_select(0, pos).float().detach() / temp[:, None]
        if needs_ref and ref_logits is not None
        else None
    )
    val = values.index_select(0, pos).float() if needs_values and values is not None else None

    # Stage 1: non-finite inputs flag their slot; the slot's rows become constants before
    # anything differentiable touches them, so their gradient is exactly zero.
    tok_ok = (
        temp_ok
        & torch.isfinite(adv)
        & torch.isfinite(ilp)
        & torch.isfinite(weight)
        & torch.isfinite(reward)
        & torch.isfinite(scaled.detach()).all(dim=-1)
    )
    if ref_scaled is not None:
        tok_ok &= torch.isfinite(ref_scaled).all(dim=-1) | (tab.kl_ref[slots] == 0)
    if val is not None:
        tok_ok &= torch.isfinite(val.detach()) | ~tok_gae
    slot_bad = _per_slot_sum(slots, ~tok_ok, n_slots, torch.long) > 0  # (n_slots,)
    tok_bad = slot_bad[slots]  # (N,)
    zero = torch.zeros((), device=device)
    scaled = torch.where(tok_bad[:, None], zero, scaled)
    adv = torch.where(tok_bad, 0.0, adv)
    ilp = torch.where(tok_bad, 0.0, ilp)
    weight = torch.where(tok_bad, 0.0, weight)
    reward = torch.where(tok_bad, 0.0, reward)

    logp_all = F.log_softmax(scaled, dim=-1)  # (N, V)
    logp = logp_all.gather(1, input_ids[tok].long()[:, None]).squeeze(1)  # (N,)
    log_ratio = logp - ilp  # (N,)
    if ref_scaled is not None:
        ref_scaled = torch.where(tok_bad[:, None], 0.0, ref_scaled)
        ref_logp = F.log_softmax(ref_scaled, dim=-1).gather(1, input_ids[tok].long()[:, None]).squeeze(1)
        # Runs that do not ask for the reference KL read their own logprob: d = 0, no gradient.
        ref_logp = torch.where(tab.kl_ref[slots] > 0, ref_logp, logp.detach())
    else:
        ref_logp = logp.detach()
    val = torch.where(tok_bad | ~tok_gae, zero, val) if val is not None else torch.zeros_like(adv)

    with torch.no_grad():
        # GAE runs: advantages and returns from their own (detached) values and rewards.
        gae_adv, returns = gae_advantages(
            rewards=reward,
            values=val.detach(),
            sample_ids=sids,
            gamma=tab.gamma[slots],
            lam=tab.lam[slots],
            active=tok_gae & ~tok_bad,
        )
        adv = torch.where(tok_gae, gae_adv, adv)

        lr = log_ratio.detach()
        tok_low, tok_high = tab.log_low[slots], tab.log_high[slots]
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
        masked = torch.where(kind == _SEQUENCE_IS, seq_masked, tok_masked) & is_ratio_masked_kind & ~tok_bad
        keep = ~masked & ~tok_bad

        entropy = -(logp_all.detach().exp() * logp_all.detach()).sum(dim=-1)  # (N,)
        # Stage 2: a loss that is still non-finite (e.g. an overflowing ratio or advantage)
        # flags its slot too; found on detached values so that the differentiable pass
        # below never evaluates it.
        probe = _token_losses(
            _TokenInputs(
                logp=logp.detach(),
                log_ratio=torch.where(keep & uses_ratio, lr, 0.0),
                adv=torch.where(keep, adv, 0.0),
                weight=weight,
                ref_logp=ref_logp.detach(),
                entropy=entropy,
                values=val.detach(),
                returns=returns,
            ),
            tab,
            slots,
        )
        late_bad = keep & ~torch.isfinite(probe)
        slot_bad |= _per_slot_sum(slots, late_bad, n_slots, torch.long) > 0
        tok_bad = slot_bad[slots]
        keep &= ~tok_bad
        masked &= ~tok_bad

        mismatch_kl = torch.exp(lr) - lr - 1.0  # (N,) k3 of KL(inference || trainer)
        # where(), not a product: a metric of a bad slot may be NaN and NaN * 0 is NaN.
        entropy = torch.where(tok_bad, 0.0, entropy)
        mismatch_kl = torch.where(tok_bad, 0.0, mismatch_kl)

    # Masked and bad tokens: ratio exactly 1, advantage 0 and the reference at the policy by
    # construction, and the final where() hands them a zero gradient without multiplying through exp().
    entropy_term = entropy
    if needs_entropy_grad:
        entropy_term = -(logp_all.exp() * logp_all).sum(dim=-1)
    per_token = _token_losses(
        _TokenInputs(
            logp=torch.where(keep, logp, zero),
            log_ratio=torch.where(keep & uses_ratio, log_ratio, zero),
            adv=torch.where(keep, adv, 0.0),
            weight=torch.where(keep, weight, 0.0),
            ref_logp=torch.where(keep, ref_logp, zero),
            entropy=torch.where(keep, entropy_term, zero),
            values=torch.where(keep, val, zero),
            returns=torch.where(keep, returns, 0.0),
        ),
        tab,
        slots,
    )
    per_token = torch.where(keep, per_token, zero)  # (N,)
    total = per_token.sum()

    masked_tokens = _per_slot_sum(slots, masked, n_slots, torch.long)
    loss_tokens = mask_tokens - masked_tokens
    token_norm = torch.where(kind == _CROSS_ENTROPY, weight, 1.0)
    with torch.no_grad():
        v_loss = torch.where(keep & tok_gae, value_loss(val, returns, tab.value_clip[slots]), 0.0)
    stats = LossStats(
        loss_sum=_per_slot_sum(slots, per_token.detach(), n_slots, torch.float64),
        loss_tokens=loss_tokens,
        entropy_sum=_per_slot_sum(slots, entropy, n_slots, torch.float64),
        mismatch_kl_sum=_per_slot_sum(
            slots, torch.where(uses_ratio, mismatch_kl, 0.0), n_slots, torch.float64
        ),
        masked_tokens=masked_tokens,
        nonfinite=slot_bad,
        normaliser=_per_slot_sum(slots, torch.where(keep, token_norm, 0.0), n_slots, torch.float64),
        value_loss_sum=_per_slot_sum(slots, v_loss, n_slots, torch.float64),
    )
    return LossResult(total=total, stats=stats)


def rl_loss(
    logits: Tensor,
    micro_batch: MicroBatchLike,
    *,
    slot_settings: SettingsTable,
    n_slots: int,
    ref_logits: Tensor | None = None,
    values: Tensor | None = None,
    advantage_settings: AdvantageTable | None = None,
) -> LossResult:
    """``compute_loss`` on a packed row (``trainer_core.packing.MicroBatch`` or anything with
    the same tensor attributes); the row's tensors are moved to the logits' device."""
    device = logits.device
    weights = getattr(micro_batch, "weights", None)
    rewards = getattr(micro_batch, "rewards", None)
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
        weights=weights.to(device) if weights is not None else None,
        ref_logits=ref_logits,
        values=values,
        rewards=rewards.to(device) if rewards is not None else None,
        advantage_settings=advantage_settings,
    )
