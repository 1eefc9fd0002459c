"""The per-token policy terms of the losses: one implementation for both callers.

    cross_entropy        -w * logp
    importance_sampling  -r * A                                   (token_is / sequence_is)
    ppo                  max(-r * A, -clip(r, low, high) * A)     = -min(r * A, clip(r) * A)
    cispo                -sg(clip(r, low, high)) * A * logp       (sg: stop-gradient)

with ``logp`` the trainer's logprob of a token, ``r = exp(logp - logp_sampler)`` its importance
ratio, ``A`` its advantage and ``w`` its weight. Elementwise over tensors of the same shape;
``low`` / ``high`` are the clip bounds themselves (floats or per-token tensors).

`trainer_core.loss` builds a run's loss from these terms (adding its KL, entropy and value terms,
ratio masking and non-finite guards over a packed micro-batch; its config's ``clip_low`` /
``clip_high`` are offsets, the bounds are ``1 - clip_low`` and ``1 + clip_high``).
`tinker_loss` below is the Tinker API's loss of one datum (`trainer_core.manual`): the same terms,
bounds from ``loss_fn_config`` (``clip_low_threshold`` / ``clip_high_threshold``, default 0.8 /
1.2), nothing added. So a ppo or cispo token costs the same on both paths.
"""

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

Bound = float | Tensor
TinkerLossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo"]
TINKER_CLIP = (0.8, 1.2)
"""The Tinker losses' default ratio bounds (its `clip_low_threshold` / `clip_high_threshold`)."""


def cross_entropy_term(logp: Tensor, weight: Tensor) -> Tensor:
    return -weight * logp


def importance_sampling_term(ratio: Tensor, adv: Tensor) -> Tensor:
    return -ratio * adv


def _clip(ratio: Tensor, low: Bound, high: Bound) -> Tensor:
    # Passes the gradient inside [low, high], bounds included.
    if isinstance(low, Tensor) or isinstance(high, Tensor):
        # torch.clamp takes bounds that are both numbers or both tensors.
        low_t = torch.as_tensor(low, dtype=ratio.dtype, device=ratio.device)
        high_t = torch.as_tensor(high, dtype=ratio.dtype, device=ratio.device)
        return torch.clamp(ratio, min=low_t, max=high_t)
    return torch.clamp(ratio, min=low, max=high)


def ppo_term(ratio: Tensor, adv: Tensor, low: Bound, high: Bound) -> Tensor:
    """The clipped surrogate: no gradient once the clip binds in the direction of the advantage."""
    return torch.maximum(-ratio * adv, -_clip(ratio, low, high) * adv)


def cispo_term(ratio: Tensor, adv: Tensor, logp: Tensor, low: Bound, high: Bound) -> Tensor:
    """The clipped ratio is a weight, not a path for gradients: every token keeps its gradient."""
    return -_clip(ratio, low, high).detach() * adv * logp


def tinker_loss(
    loss_fn: TinkerLossFn,
    logp: Tensor,
    *,
    weights: Sequence[float],
    sampler_logprobs: Sequence[float] | None,
    advantages: Sequence[float] | None,
    config: Mapping[str, float],
) -> Tensor:
    """Elementwise loss (n,) of one Tinker datum from the trainer's logprobs ``logp`` (n,) of its
    target tokens; its sum is the datum's contribution to the request's loss (no normalisation:
    Tinker's losses are sums over tokens)."""

    def as_tensor(values: Sequence[float] | None) -> Tensor:
        return torch.tensor(list(values or []), dtype=logp.dtype, device=logp.device)  # (n,)

    if loss_fn == "cross_entropy":
        return cross_entropy_term(logp, as_tensor(weights))
    adv = as_tensor(advantages)
    ratio = torch.exp(logp - as_tensor(sampler_logprobs))
    if loss_fn == "importance_sampling":
        return importance_sampling_term(ratio, adv)
    low = config.get("clip_low_threshold", TINKER_CLIP[0])
    high = config.get("clip_high_threshold", TINKER_CLIP[1])
    if loss_fn == "cispo":
        return cispo_term(ratio, adv, logp, low, high)
    return ppo_term(ratio, adv, low, high)
