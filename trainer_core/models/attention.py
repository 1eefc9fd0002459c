"""Packed attention: each sample of a packed row attends within itself only, at Σ Lᵢ² cost.

A packed row holds samples end to end (`trainer_core.packing.MicroBatch`). Attention must be causal
*within* each sample and absent *across* samples. The dense way — one (1, 1, L, L) block-diagonal mask —
spends O(L²) time and memory on blocks that are entirely masked: a row of 16 samples does 16× the useful
work. `packed_attention_forward` instead runs ``scaled_dot_product_attention(..., is_causal=True)`` on
each sample's slice of the row, so cost and memory follow Σ Lᵢ² and no mask is ever built.

Registered with transformers as the attention implementation ``"loraloom_packed"``
(`PACKED_ATTENTION`): a model loaded with ``attn_implementation=PACKED_ATTENTION`` calls it in every
attention layer. `trainer_core.modeling.forward_packed` passes the row's segment lengths as the
``packed_seq_lens`` keyword, which transformers forwards untouched from ``model(...)`` to here (and which
gradient checkpointing replays with the layer). Without ``packed_seq_lens`` — an ordinary
``model(input_ids, attention_mask=...)`` call, e.g. generation or a padded batch — it is exactly
transformers' SDPA attention, masks included (the mask builder registered with it is SDPA's), so a model
loaded this way is a drop-in everywhere else.

Why per-segment SDPA and not another kernel (torch 2.13, measured on CPU with bench/attention.py's
shapes; see docs/benchmarks.md):

- ``flex_attention`` with a block mask: no backward on CPU ("FlexAttention does not support backward on
  CPU"), and it needs ``torch.compile`` to skip masked blocks at all.
- nested (jagged) tensors through SDPA: ``is_causal=True`` is not supported for jagged queries, so no
  backend runs.
- ``torch.nn.attention.varlen.varlen_attn``: CUDA only (flash/cuDNN), fp16/bf16 only.
- one batched SDPA over the samples padded to the longest: the same time as the per-segment loop on CPU
  (L = 4k and 8k, 16 samples: within noise), but it pays for the padding and for two gathers.

Per-segment SDPA runs on every device and dtype, its FLOPs are exactly the useful ones, and the
per-call overhead (one SDPA per sample and layer) is microseconds on CPU. On CUDA the flash-attention
varlen path (``flash_attention_2``, when ``flash_attn`` is installed) is preferred: one kernel per layer
whatever the number of samples; `trainer_core.models.precision.default_attn_implementation` picks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["PACKED_ATTENTION", "packed_attention_forward", "segment_attention"]

PACKED_ATTENTION = "loraloom_packed"
"""The attention implementation name a model is loaded with to use `packed_attention_forward`."""


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_lens: Sequence[int],
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each segment of a packed row; (1, H, L, D) → (1, H, L, D).

    query (1, H, L, D), key/value (1, H_kv, L, D) with H a multiple of H_kv (grouped-query attention is
    handled by SDPA's ``enable_gqa``, no copy of the keys). ``seq_lens`` are the segments' lengths, in
    order, summing to L (padding is a segment of its own, as in `MicroBatch.seq_lens`). With
    ``sliding_window`` W, token i also needs i - j < W, as in transformers' sliding-window mask.
    """
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row (batch 1), got batch {query.shape[0]}")
    length = query.shape[2]
    if sum(seq_lens) != length or any(n <= 0 for n in seq_lens):
        raise ValueError(
            f"packed_seq_lens {list(seq_lens)[:8]}... must be positive and sum to the row length {length}"
        )
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    start = 0
    for n in seq_lens:
        end = start + n
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]  # (1, h, n, D)
        if sliding_window is not None and n > sliding_window:
            # Only a sample longer than the window needs a mask, and only its own (n, n).
            idx = torch.arange(n, device=query.device)
            band = (idx[:, None] >= idx[None, :]) & (idx[:, None] - idx[None, :] < sliding_window)  # (n, n)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=band, dropout_p=dropout, scale=scaling, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa
            )
        outputs.append(out)  # (1, H, n, D)
        start = end
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # (1, H, L, D)


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed_seq_lens: Sequence[int] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; returns ((B, L, H, D) output, no weights).

    With ``packed_seq_lens`` (a packed row from `forward_packed`): `segment_attention`, and
    ``attention_mask`` is ignored (forward_packed arranges for it to be None). Without it: transformers'
    SDPA attention, unchanged.
    """
    if packed_seq_lens is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    unsupported = sorted(k for k in ("softcap", "s_aux", "position_bias") if kwargs.get(k) is not None)
    if unsupported or not getattr(module, "is_causal", True):
        raise NotImplementedError(
            f"packed attention supports plain causal attention only; this layer uses {unsupported or 'bidirectional attention'}"
        )
    out = segment_attention(
        query, key, value, packed_seq_lens, scaling=scaling, dropout=dropout, sliding_window=sliding_window
    )
    return out.transpose(1, 2).contiguous(), None  # (1, L, H, D)


# Registered once, at import: the name must be known before a model is built with it. The mask builder
# is SDPA's, so unpacked calls get exactly SDPA's masks (padding, sliding windows).
AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
