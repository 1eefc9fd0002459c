"""The packed forward: one row of several samples through a Hugging Face causal LM, with no attention
across samples.

A packed row (`trainer_core.packing.MicroBatch`) holds samples end to end. Two things keep each sample
exactly as if it ran alone:

- **Positions** restart at 0 for every sample (``micro_batch.position_ids``), so rotary embeddings see
  each sample's own positions.
- **Attention is block-diagonal causal**: token i may attend to token j only if both are in the same
  sample (or the padding pseudo-sequence) and j ≤ i. How, per attention implementation
  (``model.config._attn_implementation``):

  * `PACKED_ATTENTION` (``"loraloom_packed"``, the default on CPU, and on GPU without flash-attention):
    the row's segment lengths go to `trainer_core.models.attention.packed_attention_forward` as
    ``packed_segments``; it runs SDPA with ``is_causal=True`` per sample (short samples several to a
    call, padded), so cost and memory follow Σ Lᵢ² and no mask is built. The attention mask passed is an all-ones (1, L) padding mask: with
    it transformers neither infers packing from the restarting positions (which would build a dense
    mask) nor builds a causal one (SDPA's mask builder skips an all-ones mask).
  * ``"flash_attention_2"`` / ``"flash_attention_3"`` (GPU): no mask; the row's ``cu_seqlens`` (from
    ``seq_lens``) and max length go to transformers' flash path as ``cu_seq_lens_q/k`` and
    ``max_length_q/k``, which calls ``flash_attn_varlen_func`` — O(L) memory and no wasted FLOPs on
    masked blocks. Selected by default on CUDA when ``flash_attn`` is installed; it is not exercised by
    the CPU test-suite.
  * ``"eager"`` / ``"sdpa"`` (the old path, kept for comparison): an explicit additive 4-D mask
    (`packed_attention_mask`, shape (1, 1, L, L), 0 where allowed and the dtype's minimum elsewhere).
    transformers 5.x (``masking_utils._preprocess_mask_arguments``) passes any 4-D tensor mask through
    untouched; eager adds it to the scores, SDPA takes it as ``attn_mask``. Time and memory are O(L²)
    per row whatever the samples' lengths (eager stores (1, heads, L, L) scores per layer).
  * ``"flex_attention"``: no mask; transformers derives a packed BlockMask from the restarting
    ``position_ids`` itself (``find_packed_sequence_indices``).

Why explicit layouts rather than relying on that detection for every path: transformers only infers
packing when no mask *and no cache* is passed — a model in eval mode defaults to ``use_cache=True``,
which silently turns it off and lets samples attend across each other. The explicit layout (and
``use_cache=False``) does not depend on that heuristic; the tests check that both agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from trainer_core.models.attention import PACKED_ATTENTION, PackedSegments
from trainer_core.packing import MicroBatch

__all__ = ["forward_packed", "packed_attention_mask", "segment_ids"]


def segment_ids(seq_lens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """(L,) long: the index of each token's segment (sample or padding pseudo-sequence)."""
    lens = torch.as_tensor(list(seq_lens), dtype=torch.long, device=device)  # (S,)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)  # (L,)


def packed_attention_mask(
    seq_lens: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(1, 1, L, L) additive block-diagonal causal mask: 0 where token i may attend to token j (same
    segment, j ≤ i), ``torch.finfo(dtype).min`` elsewhere.

    Every row allows at least its own diagonal, so softmax never sees a fully masked row (no NaN), padding
    included (it is its own segment).
    """
    seg = segment_ids(seq_lens, device)  # (L,)
    length = seg.shape[0]
    idx = torch.arange(length, device=device)  # (L,)
    allowed = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])  # (L, L)
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]  # (1, 1, L, L)


def _is_flash(impl: str | None) -> bool:
    return impl is not None and "flash_attention" in impl


def forward_packed(model: nn.Module, micro_batch: MicroBatch, **model_kwargs: Any) -> torch.Tensor:
    """Logits (L, V) of a Hugging Face causal LM on one packed row; attention never crosses samples.

    ``model_kwargs`` pass through to ``model(...)`` (e.g. what the multi-LoRA layers need). The inputs are
    moved to the model's device; logits come back on it.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    input_ids = micro_batch.input_ids.to(device)[None]  # (1, L)
    position_ids = micro_batch.position_ids.to(device)[None]  # (1, L)
    impl = getattr(model.config, "_attn_implementation", None)
    attention_mask: torch.Tensor | None
    if impl == PACKED_ATTENTION:
        model_kwargs["packed_segments"] = PackedSegments(micro_batch.seq_lens)
        attention_mask = torch.ones(input_ids.shape, dtype=torch.bool, device=device)  # (1, L)
    elif _is_flash(impl):
        lens = torch.tensor(micro_batch.seq_lens, dtype=torch.int32, device=device)  # (S,)
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))  # (S+1,)
        longest = max(micro_batch.seq_lens)
        model_kwargs.update(
            cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=longest, max_length_k=longest
        )
        attention_mask = None
    elif impl == "flex_attention":
        attention_mask = None  # transformers builds the packed BlockMask from position_ids
    else:
        attention_mask = packed_attention_mask(micro_batch.seq_lens, dtype=dtype, device=device)
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=False,
        **model_kwargs,
    )
    return out.logits[0]  # (L, V)
