"""Packed attention: each sample of a packed row attends within itself only, at Σ Lᵢ² cost.

A packed row holds samples end to end (`trainer_core.packing.MicroBatch`). Attention must be causal
*within* each sample and absent *across* samples. The dense way — one (1, 1, L, L) block-diagonal mask —
spends O(L²) time and memory on blocks that are entirely masked: a row of 16 samples does 16× the useful
work. `segment_attention` instead runs ``scaled_dot_product_attention(..., is_causal=True)`` per sample:
a long sample gets a call of its own on its slice of the row (a view, no copy); short samples share a
call as a padded batch (the padding costs less than the calls it saves, see `CALL_COST_TOKENS`), which is
exact because padding comes after each sample's tokens and attention is causal. Cost and memory follow
Σ Lᵢ² and no mask is ever built.

Registered with transformers as the attention implementation ``"loraloom_packed"``
(`PACKED_ATTENTION`): a model loaded with ``attn_implementation=PACKED_ATTENTION`` calls it in every
attention layer. `trainer_core.modeling.forward_packed` passes the row's layout as the
``packed_segments`` keyword (a `PackedSegments`), which transformers forwards untouched from
``model(...)`` to here (and which gradient checkpointing replays with the layer). Without it — an
ordinary ``model(input_ids, attention_mask=...)`` call, e.g. generation or a padded batch — it is exactly
transformers' SDPA attention, masks included (the mask builder registered with it is SDPA's), so a model
loaded this way is a drop-in everywhere else.

Why SDPA per sample and not another kernel (torch 2.13, CPU; `bench/attention.py`, docs/benchmarks.md):

- ``flex_attention`` with a block mask: no backward on CPU ("FlexAttention does not support backward on
  CPU"), and without ``torch.compile`` it does not skip masked blocks anyway.
- nested (jagged) tensors through SDPA: ``is_causal=True`` is not supported for jagged queries, so no
  backend runs.
- ``torch.nn.attention.varlen.varlen_attn``: CUDA only (flash/cuDNN), fp16/bf16 only.
- one SDPA with the dense block-diagonal mask (what eager/SDPA did before): 15–18× the batched time at
  L = 4096 with 16 samples, 50–90× with 64–256 samples (attention alone, forward + backward).

Per-sample SDPA runs on every device and dtype, does only the useful FLOPs (plus bounded padding), and at
L = 4096 costs 1.03–1.2× the same samples as a plain batch (attention alone). On CUDA the flash-attention
varlen path (``flash_attention_2``, when ``flash_attn`` is installed) is preferred: one kernel per layer
whatever the number of samples; `trainer_core.models.precision.default_attn_implementation` picks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = [
    "CALL_COST_TOKENS",
    "PACKED_ATTENTION",
    "PackedSegments",
    "packed_attention_forward",
    "segment_attention",
]

PACKED_ATTENTION = "loraloom_packed"
"""The attention implementation name a model is loaded with to use `packed_attention_forward`."""


CALL_COST_TOKENS = 64
"""Short segments share an SDPA call, padded to the longest of the call, while the padding costs less than
a call of their own: a segment of n tokens joins a call of width m when m² ≤ n² + CALL_COST_TOKENS².
Calibrated on CPU (torch 2.13, 1 thread, 14 query / 2 KV heads of 64, forward + backward, rows of 4096
tokens with log-normal lengths): with mean lengths 8 / 32 / 128 tokens (384 / 77 / 25 samples), 0 (no
sharing) took 469 / 612 / 491 ms, 32 took 248 / 303 / 477, 64 took 301 / 286 / 430, 128 took
1622 / 390 / 418."""


@dataclass(frozen=True)
class _Bucket:
    """Segments attended in one SDPA call, side by side as a (k, m) batch: sliced from the row when they
    are consecutive and of equal length (a view, no copy), else gathered and padded to the longest."""

    start: int
    """First token of the slice (when ``gather`` is None)."""
    count: int
    """k: the segments in the call."""
    width: int
    """m: the longest of them; the others are padded to it."""
    gather: torch.Tensor | None
    """(k·m,) token positions of the padded (k, m) layout, None for a slice. A padding slot
    repeats its segment's first token: it is attended to only by padding queries (it comes after every
    real token of the segment, and attention is causal), whose outputs are dropped."""


@dataclass(frozen=True)
class _Plan:
    buckets: tuple[_Bucket, ...]
    inverse: torch.Tensor | None
    """(L,) position of each row token among the buckets' concatenated outputs; None when they are the
    row in order already (one segment, or equal lengths)."""


class PackedSegments:
    """A packed row's segment lengths (padding is a segment of its own, as in `MicroBatch.seq_lens`), and
    the plan of SDPA calls derived from them, built once per device and window and shared by every layer
    of the forward (and of its recomputation under gradient checkpointing)."""

    def __init__(self, seq_lens: Sequence[int]) -> None:
        self.seq_lens = tuple(int(n) for n in seq_lens)
        if not self.seq_lens or any(n <= 0 for n in self.seq_lens):
            raise ValueError(f"packed segment lengths must be positive, got {list(self.seq_lens)[:8]}")
        self.length = sum(self.seq_lens)
        self._plans: dict[tuple[torch.device, int | None], _Plan] = {}

    def plan(self, device: torch.device, sliding_window: int | None) -> _Plan:
        key = (device, sliding_window)
        if key not in self._plans:
            self._plans[key] = self._make_plan(device, sliding_window)
        return self._plans[key]

    def _groups(self, sliding_window: int | None) -> list[list[int]]:
        """Segment indices per SDPA call: longest first, each joining the current call while padding it
        costs less than a call of its own. A segment longer than the window is always alone (its band
        mask is its own)."""
        lens = self.seq_lens
        groups: list[list[int]] = []
        for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
            alone = sliding_window is not None and lens[i] > sliding_window
            if groups and not alone:
                head = lens[groups[-1][0]]
                head_alone = sliding_window is not None and head > sliding_window
                if not head_alone and head * head <= lens[i] * lens[i] + CALL_COST_TOKENS**2:
                    groups[-1].append(i)
                    continue
            groups.append([i])
        return groups

    def _make_plan(self, device: torch.device, sliding_window: int | None) -> _Plan:
        lens = torch.tensor(self.seq_lens)  # (S,)
        starts = torch.cumsum(lens, 0) - lens  # (S,)
        seg_base = torch.zeros_like(lens)  # (S,) where each segment's output starts, in call order
        buckets, base = [], 0
        for group in self._groups(sliding_window):
            idx = torch.tensor(group)  # (k,)
            k, width = len(group), self.seq_lens[group[0]]
            offsets = torch.arange(width)[None, :]  # (1, m)
            inside = torch.where(offsets < lens[idx, None], offsets, 0)  # (k, m)
            positions = (starts[idx, None] + inside).flatten()  # (k·m,)
            first = int(positions[0])
            is_slice = bool((positions == torch.arange(first, first + k * width)).all())
            gather = None if is_slice else positions.to(device)
            seg_base[idx] = base + width * torch.arange(k)
            buckets.append(_Bucket(start=first, count=k, width=width, gather=gather))
            base += k * width
        seg = torch.repeat_interleave(torch.arange(len(lens)), lens)  # (L,)
        inverse = seg_base[seg] + torch.arange(self.length) - starts[seg]  # (L,)
        in_order = base == self.length and bool((inverse == torch.arange(self.length)).all())
        return _Plan(tuple(buckets), None if in_order else inverse.to(device))


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: PackedSegments | Sequence[int],
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention within each segment of a packed row; (1, H, L, D) → (L, H, D).

    query (1, H, L, D), key/value (1, H_kv, L, D) with H a multiple of H_kv (grouped-query attention is
    handled by SDPA's ``enable_gqa``, no copy of the keys). ``segments``: the segments' lengths in order,
    summing to L. Long segments get an SDPA call each, on a slice of the row; short ones share calls,
    padded (see `CALL_COST_TOKENS`). With ``sliding_window`` W, token i also needs i - j < W, as in
    transformers' sliding-window mask.
    """
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row (batch 1), got batch {query.shape[0]}")
    if not isinstance(segments, PackedSegments):
        segments = PackedSegments(segments)
    if segments.length != query.shape[2]:
        raise ValueError(
            f"packed segment lengths {list(segments.seq_lens)[:8]} sum to {segments.length}, "
            f"not to the row length {query.shape[2]}"
        )
    plan = segments.plan(query.device, sliding_window)
    gqa = query.shape[1] != key.shape[1]
    outputs = []
    for bucket in plan.buckets:
        shape = (bucket.count, bucket.width)
        if bucket.gather is None:
            end = bucket.start + bucket.count * bucket.width
            rows = [t[0, :, bucket.start : end] for t in (query, key, value)]  # (h, k·m, D) views
        else:
            rows = [t[0].index_select(1, bucket.gather) for t in (query, key, value)]  # (h, k·m, D)
        q, k, v = (r.unflatten(1, shape).transpose(0, 1) for r in rows)  # (k, h, m, D)
        mask = None
        if sliding_window is not None and bucket.width > sliding_window:  # then a call of one segment
            idx = torch.arange(bucket.width, device=query.device)
            mask = (idx[:, None] >= idx[None, :]) & (idx[:, None] - idx[None, :] < sliding_window)  # (m, m)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None, enable_gqa=gqa
        )  # (k, H, m, D)
        outputs.append(out.transpose(1, 2).flatten(0, 1))  # (k·m, H, D)
    flat = outputs[0] if len(outputs) == 1 else torch.cat(outputs)  # (P, H, D)
    return flat if plan.inverse is None else flat.index_select(0, plan.inverse)  # (L, H, D)


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    packed_segments: PackedSegments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; returns ((B, L, H, D) output, no weights).

    With ``packed_segments`` (a packed row from `forward_packed`): `segment_attention`, and
    ``attention_mask`` is ignored (forward_packed arranges for it to be None). Without it: transformers'
    SDPA attention, unchanged.
    """
    if packed_segments is None:
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
        query, key, value, packed_segments, scaling=scaling, dropout=dropout, sliding_window=sliding_window
    )
    return out[None], None  # (1, L, H, D)


# Registered once, at import: the name must be known before a model is built with it. The mask builder
# is SDPA's, so unpacked calls get exactly SDPA's masks (padding, sliding windows).
AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
