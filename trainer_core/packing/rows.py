"""One packed row (`MicroBatch`) and how buffered samples are laid out in it.

Sample boundaries survive packing: ``position_ids`` restart at 0 for every sample (and for the padding
pseudo-sequence), ``seq_lens`` lists the segment lengths, and `trainer_core.modeling.forward_packed`
makes attention block-diagonal so no token attends across samples. Inside a row, samples are in
ascending slot order, so each run's tokens form one contiguous segment (what the multi-LoRA layers
need: per-slot token counts). The first token of every sample never carries loss even if it is a
completion token (empty prompt): the loss predicts token ``t`` from ``logits[t − 1]``, which would
belong to the previous sample. Rows are padded to ``min(ceil(len / pad_to_multiple_of) ×
pad_to_multiple_of, seq_len)``: never above ``seq_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from trainer_core.packing.buffer import SampleChunk

__all__ = ["Member", "MicroBatch", "RowFormat", "SampleRef"]


@dataclass(frozen=True, slots=True)
class SampleRef:
    """Identifies one consumed sample, so the trainer can acknowledge whole batches."""

    batch_id: int
    """The service's id of the rollout batch."""
    index: int
    """The sample's index inside that batch (counting the skipped leading samples too)."""


@dataclass
class MicroBatch:
    """One packed row: several samples (possibly of several runs) laid end to end, then padding.

    All tensors are on CPU and have length ``L`` = the padded row length (≤ ``seq_len``).
    """

    input_ids: torch.Tensor
    """(L,) long. Prompt then completion of each sample, then ``pad_token_id``."""
    position_ids: torch.Tensor
    """(L,) long. Restart at 0 for every sample and for the padding pseudo-sequence."""
    loss_mask: torch.Tensor
    """(L,) bool. True on completion tokens whose ``completion_mask`` is True, except a sample's first
    token (the loss predicts token t from ``logits[t-1]``, which must lie in the same sample)."""
    advantages: torch.Tensor
    """(L,) float32. The sample's advantage on its completion tokens (scalar broadcast, or per token); 0
    elsewhere."""
    inference_logprobs: torch.Tensor
    """(L,) float32. The inference policy's logprob on completion tokens; 0 elsewhere."""
    temperatures: torch.Tensor
    """(L,) float32. The sampling temperature of each token's batch; 1.0 on padding (safe to divide by)."""
    teacher_logprobs: torch.Tensor | None
    """(L,) float32 teacher logprobs on completion tokens (0 elsewhere), or None when no sample in the row
    has any."""
    token_slots: torch.Tensor
    """(L,) long. The slot (run) of each token; non-decreasing. Padding takes the last slot present."""
    sample_ids: torch.Tensor
    """(L,) long. Index of the token's sample in ``seq_lens`` order; -1 on padding."""
    seq_lens: list[int]
    """Lengths of the samples in order, then the padding as a final pseudo-sequence (if any)."""
    slot_token_counts: torch.Tensor
    """(n_slots,) long. Tokens per slot in ascending slot order; padding is counted in the last slot
    present (slot 0 for an empty row), so the counts sum to L."""
    is_filler: bool = False
    """True for a filler row that only keeps ranks in step (no loss, no samples)."""
    weights: torch.Tensor | None = None
    """(L,) float32 per-token loss weights of `cross_entropy` runs on completion tokens (0 elsewhere), or
    None when no sample in the row has `weights` (then the loss mask is the weight)."""
    rewards: torch.Tensor | None = None
    """(L,) float32 rewards for GAE runs on completion tokens: `token_rewards`, or the scalar `reward` on
    the sample's last loss-carrying completion token; 0 elsewhere. None when no sample has any."""

    @property
    def num_tokens(self) -> int:
        """L, padding included."""
        return int(self.input_ids.shape[0])

    @property
    def num_samples(self) -> int:
        """Real samples in the row (``seq_lens`` minus the padding pseudo-sequence, if any)."""
        return len(self.seq_lens) - int(self.sample_ids[-1].item() < 0)


Member = tuple[int, SampleChunk, int]
"""One sample of a row: (slot, its buffered chunk, its index in the chunk)."""


@dataclass(frozen=True)
class RowFormat:
    """How rows of one pool are laid out; builds rows from buffered samples, and fillers.

    A row's every field is built by one ``np.concatenate`` of slices of the chunks' flat arrays (and
    of constant zero / ``arange`` arrays for prompts, positions and padding) or one ``np.repeat`` of
    per-segment values: memcpy-speed work per token, a few slices per sample, nothing per token in
    Python.
    """

    n_slots: int
    """``slot_token_counts`` has this length."""
    seq_len: int
    pad_to_multiple_of: int
    pad_token_id: int
    _arange: np.ndarray = field(init=False, repr=False, compare=False)
    _zeros_f32: np.ndarray = field(init=False, repr=False, compare=False)
    _zeros_bool: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Read-only sources of the constant segments (np.concatenate copies them into each row).
        object.__setattr__(self, "_arange", np.arange(self.seq_len, dtype=np.int64))
        object.__setattr__(self, "_zeros_f32", np.zeros(self.seq_len, dtype=np.float32))
        object.__setattr__(self, "_zeros_bool", np.zeros(self.seq_len, dtype=np.bool_))

    def padded_length(self, length: int) -> int:
        """``length`` rounded up to ``pad_to_multiple_of``, never above ``seq_len``."""
        m = self.pad_to_multiple_of
        return min(-(-length // m) * m, self.seq_len)

    def build(self, members: list[Member]) -> MicroBatch:
        """Lay out one bin (members in ascending slot order) as a padded row."""
        zeros_f32, zeros_bool = self._zeros_f32, self._zeros_bool
        seq_lens: list[int] = []
        ids: list[np.ndarray] = []
        loss: list[np.ndarray] = []
        logprobs: list[np.ndarray] = []
        advantages: list[float] = []  # per segment: 0 on a prompt, the advantage on a completion
        segment_lens: list[int] = []  # prompt, completion, prompt, completion, ..., padding
        empty_prompt_starts: list[int] = []
        plain = True  # no member has per-token advantages, teacher logprobs, weights or rewards
        used = 0
        for _, chunk, k in members:
            t0, t1, c0, c1, n_prompt = chunk.spans[k]
            seq_lens.append(t1 - t0)
            segment_lens += (n_prompt, c1 - c0)
            ids.append(chunk.ids[t0:t1])
            loss += (zeros_bool[:n_prompt], chunk.completion_mask[c0:c1])
            logprobs += (zeros_f32[:n_prompt], chunk.logprobs[c0:c1])
            if chunk.plain:
                advantages += (0.0, chunk.advantage_scalars[k])  # type: ignore[index]
            else:
                plain = False
            if not n_prompt:
                empty_prompt_starts.append(used)
            used += t1 - t0
        length = self.padded_length(used)
        pad = length - used
        segment_lens.append(pad)
        loss.append(zeros_bool[:pad])
        logprobs.append(zeros_f32[:pad])

        input_ids = np.empty(length, dtype=np.int64)  # (L,)
        np.concatenate(ids, out=input_ids[:used])
        input_ids[used:] = self.pad_token_id
        loss_mask = np.concatenate(loss)
        # A sample's first token has no in-sample predecessor: no loss even when it is a completion token.
        loss_mask[empty_prompt_starts] = False
        all_lens = seq_lens + [pad]  # the padding is a final (possibly empty) segment
        slots = [slot for slot, _, _ in members]
        counts = [0] * self.n_slots
        for slot, n in zip(slots, seq_lens, strict=True):
            counts[slot] += n
        counts[slots[-1]] += pad  # padding counts in the last slot present
        sample_index = list(range(len(members)))
        sample_index.append(-1)  # padding
        if plain:
            advantages.append(0.0)
            row_advantages = np.repeat(np.asarray(advantages, dtype=np.float32), segment_lens)
        else:
            row_advantages = self._advantages(members, pad)
        return MicroBatch(
            input_ids=torch.from_numpy(input_ids),
            position_ids=torch.from_numpy(np.concatenate([self._arange[:n] for n in all_lens])),
            loss_mask=torch.from_numpy(loss_mask),
            advantages=torch.from_numpy(row_advantages),
            inference_logprobs=torch.from_numpy(np.concatenate(logprobs)),
            temperatures=torch.from_numpy(
                np.repeat(np.asarray([c.temperature for _, c, _ in members] + [1.0], np.float32), all_lens)
            ),
            teacher_logprobs=None if plain else self._optional(members, pad, "teacher", "has_teacher"),
            token_slots=torch.from_numpy(np.repeat(np.asarray(slots + slots[-1:], np.int64), all_lens)),
            sample_ids=torch.from_numpy(np.repeat(np.asarray(sample_index, np.int64), all_lens)),
            seq_lens=seq_lens + [pad] if pad else seq_lens,
            slot_token_counts=torch.from_numpy(np.asarray(counts, dtype=np.int64)),
            is_filler=False,
            weights=None
            if plain
            else self._optional(members, pad, "weights", "has_weights", default_to_mask=True),
            rewards=None if plain else self._optional(members, pad, "rewards", "has_rewards"),
        )

    def _advantages(self, members: list[Member], pad: int) -> np.ndarray:
        """(L,) float32: each sample's advantage on its completion tokens, 0 elsewhere."""
        zeros_f32 = self._zeros_f32
        pieces: list[np.ndarray] = []
        for _, chunk, k in members:
            _, _, c0, c1, n_prompt = chunk.spans[k]
            pieces.append(zeros_f32[:n_prompt])
            if chunk.advantage_tokens is not None:
                pieces.append(chunk.advantage_tokens[c0:c1])
            else:
                assert chunk.advantage_scalars is not None
                pieces.append(np.full(c1 - c0, chunk.advantage_scalars[k], np.float32))
        pieces.append(zeros_f32[:pad])
        return np.concatenate(pieces)

    def _optional(
        self, members: list[Member], pad: int, values: str, flags: str, *, default_to_mask: bool = False
    ) -> torch.Tensor | None:
        """(L,) float32 of an optional per-completion-token field on completion tokens, or None when no
        member has it. Members without it give 0, or with ``default_to_mask`` their completion mask
        as 0/1 (the implicit loss weights)."""
        if not any((f := getattr(chunk, flags)) is not None and f[k] for _, chunk, k in members):
            return None
        zeros_f32 = self._zeros_f32
        pieces: list[np.ndarray] = []
        for _, chunk, k in members:
            _, _, c0, c1, n_prompt = chunk.spans[k]
            pieces.append(zeros_f32[:n_prompt])
            source = getattr(chunk, values)
            if source is not None:
                pieces.append(source[c0:c1])
            elif default_to_mask:
                pieces.append(chunk.completion_mask[c0:c1])
            else:
                pieces.append(zeros_f32[: c1 - c0])
        pieces.append(zeros_f32[:pad])
        return torch.from_numpy(np.concatenate(pieces, dtype=np.float32))

    def filler(self) -> MicroBatch:
        """A minimal row of padding (no samples, no loss) that keeps a rank's pass count in step."""
        length = self.padded_length(1)
        zeros = torch.zeros(length, dtype=torch.float32)
        counts = torch.zeros(self.n_slots, dtype=torch.long)
        counts[0] = length  # an empty row's padding counts in slot 0
        return MicroBatch(
            input_ids=torch.full((length,), self.pad_token_id, dtype=torch.long),
            position_ids=torch.arange(length, dtype=torch.long),
            loss_mask=torch.zeros(length, dtype=torch.bool),
            advantages=zeros,
            inference_logprobs=zeros.clone(),
            temperatures=torch.ones(length, dtype=torch.float32),
            teacher_logprobs=None,
            token_slots=torch.zeros(length, dtype=torch.long),
            sample_ids=torch.full((length,), -1, dtype=torch.long),
            seq_lens=[length],
            slot_token_counts=counts,
            is_filler=True,
        )
