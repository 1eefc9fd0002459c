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

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["BufferedSample", "MicroBatch", "RowFormat", "SampleRef"]


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


@dataclass(slots=True)
class BufferedSample:
    """One buffered sample, already as arrays: converted once per batch at arrival (list → array is the
    per-token cost; doing it in `Packer.add_batch` keeps `Packer.pack` to copies, and arrays hold a
    token in 1–8 bytes where a Python list holds ~32)."""

    ids: np.ndarray
    """(n,) int64: prompt then completion token ids."""
    n_prompt: int
    completion_mask: np.ndarray
    """(C,) bool."""
    completion_logprobs: np.ndarray
    """(C,) float32."""
    advantage: float | np.ndarray
    """A scalar, or (C,) float32."""
    teacher_logprobs: np.ndarray | None
    """(C,) float32, or None."""
    temperature: float
    """The sampling temperature of the sample's batch."""
    ref: SampleRef
    loss_tokens: int
    """Tokens that will carry loss in a row (completion_mask, minus a sample-initial token)."""
    arrived_at: float
    """Packer clock when its batch was added (for the timeout)."""
    weights: np.ndarray | None = None
    """(C,) float32 per-token loss weights (the sample's `weights`), or None."""
    rewards: np.ndarray | None = None
    """(C,) float32 per-token rewards (`token_rewards`, or `reward` placed on the last loss token), or None."""

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]


@dataclass
class RowLayout:
    """Per-token layout of one row, derived from per-sample lengths."""

    seq_lens: list[int]
    """Sample lengths, then the padding length if any."""
    lens: np.ndarray
    """(S+1,) int64: the samples' lengths, then the padding's (possibly 0)."""
    starts: np.ndarray
    """(S,) int64: the first token of each real sample."""
    positions: np.ndarray
    """(L,) int64: position inside the token's segment."""
    sample_ids: np.ndarray
    """(L,) int64: sample index, -1 on padding."""
    token_slots: np.ndarray
    """(L,) int64."""
    temperatures: np.ndarray
    """(L,) float32."""


def _scatter(is_completion: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
    """(L,) float32: the samples' completion ``values`` on the completion tokens in order, 0 elsewhere."""
    out = np.zeros(is_completion.shape[0], dtype=np.float32)
    out[is_completion] = np.concatenate(values)
    return out


@dataclass(frozen=True)
class RowFormat:
    """How rows of one pool are laid out; builds rows from buffered samples, and fillers."""

    n_slots: int
    """``slot_token_counts`` has this length."""
    seq_len: int
    pad_to_multiple_of: int
    pad_token_id: int

    def padded_length(self, length: int) -> int:
        """``length`` rounded up to ``pad_to_multiple_of``, never above ``seq_len``."""
        m = self.pad_to_multiple_of
        return min(-(-length // m) * m, self.seq_len)

    def build(self, members: list[tuple[int, BufferedSample]]) -> MicroBatch:
        """Lay out one bin (members in ascending slot order) as a padded row: array copies and
        vectorised index arithmetic, no per-token Python."""
        seq_lens = [item.num_tokens for _, item in members]
        used = sum(seq_lens)
        length = self.padded_length(used)
        pad = length - used
        layout = self._layout(
            seq_lens,
            [slot for slot, _ in members],
            [item.temperature for _, item in members],
            pad=pad,
            pad_slot=members[-1][0],
        )
        input_ids = np.full(length, self.pad_token_id, dtype=np.int64)  # (L,)
        input_ids[:used] = np.concatenate([item.ids for _, item in members])
        # Completion tokens: a token is one when its position in its sample is past the prompt.
        prompt_lens = [item.n_prompt for _, item in members] + [length]  # padding: never completion
        is_completion = layout.positions >= np.repeat(
            np.asarray(prompt_lens, dtype=np.int64), layout.lens
        )  # (L,)
        loss_mask = np.zeros(length, dtype=np.bool_)
        loss_mask[is_completion] = np.concatenate([item.completion_mask for _, item in members])
        loss_mask[layout.starts] = False  # a sample's first token has no in-sample predecessor
        completion_lens = [item.completion_mask.shape[0] for _, item in members]
        if all(isinstance(item.advantage, float) for _, item in members):  # the usual case: one call
            advantages = [
                np.repeat(np.asarray([item.advantage for _, item in members], np.float32), completion_lens)
            ]
        else:
            advantages = [
                item.advantage
                if isinstance(item.advantage, np.ndarray)
                else np.full(n, item.advantage, np.float32)
                for (_, item), n in zip(members, completion_lens, strict=True)
            ]
        teacher = None
        if any(item.teacher_logprobs is not None for _, item in members):
            teacher = [
                item.teacher_logprobs if item.teacher_logprobs is not None else np.zeros(n, np.float32)
                for (_, item), n in zip(members, completion_lens, strict=True)
            ]
        logprobs = [item.completion_logprobs for _, item in members]
        weights = rewards = None
        if any(item.weights is not None for _, item in members):
            weights = [
                item.weights if item.weights is not None else item.completion_mask.astype(np.float32)
                for _, item in members
            ]
        if any(item.rewards is not None for _, item in members):
            rewards = [
                item.rewards if item.rewards is not None else np.zeros(n, np.float32)
                for (_, item), n in zip(members, completion_lens, strict=True)
            ]
        return MicroBatch(
            input_ids=torch.from_numpy(input_ids),
            position_ids=torch.from_numpy(layout.positions),
            loss_mask=torch.from_numpy(loss_mask),
            advantages=torch.from_numpy(_scatter(is_completion, advantages)),
            inference_logprobs=torch.from_numpy(_scatter(is_completion, logprobs)),
            temperatures=torch.from_numpy(layout.temperatures),
            teacher_logprobs=torch.from_numpy(_scatter(is_completion, teacher))
            if teacher is not None
            else None,
            token_slots=torch.from_numpy(layout.token_slots),
            sample_ids=torch.from_numpy(layout.sample_ids),
            seq_lens=layout.seq_lens,
            slot_token_counts=torch.from_numpy(np.bincount(layout.token_slots, minlength=self.n_slots)),
            is_filler=False,
            weights=torch.from_numpy(_scatter(is_completion, weights)) if weights is not None else None,
            rewards=torch.from_numpy(_scatter(is_completion, rewards)) if rewards is not None else None,
        )

    def _layout(
        self, sample_lens: list[int], slots: list[int], temperatures: list[float], *, pad: int, pad_slot: int
    ) -> RowLayout:
        """Per-token layout arrays from per-sample lengths (the padding pseudo-sequence appended)."""
        seq_lens = sample_lens + [pad] if pad else list(sample_lens)
        lens = np.asarray(
            seq_lens + ([] if pad else [0]), dtype=np.int64
        )  # (S+1,): a 0-length tail if no pad
        ends = np.cumsum(lens)
        starts = ends - lens  # (S+1,)
        length = int(ends[-1])
        n = len(sample_lens)
        return RowLayout(
            seq_lens=seq_lens,
            lens=lens,
            starts=starts[:n],
            positions=np.arange(length, dtype=np.int64) - np.repeat(starts, lens),
            sample_ids=np.repeat(np.append(np.arange(n, dtype=np.int64), -1), lens),
            token_slots=np.repeat(np.asarray(slots + [pad_slot], dtype=np.int64), lens),
            temperatures=np.repeat(np.asarray(temperatures + [1.0], dtype=np.float32), lens),
        )

    def filler(self) -> MicroBatch:
        """A minimal row of padding (no samples, no loss) that keeps a rank's pass count in step."""
        length = self.padded_length(1)
        layout = self._layout([], [], [], pad=length, pad_slot=0)
        zeros = torch.zeros(length, dtype=torch.float32)
        return MicroBatch(
            input_ids=torch.full((length,), self.pad_token_id, dtype=torch.long),
            position_ids=torch.from_numpy(layout.positions),
            loss_mask=torch.zeros(length, dtype=torch.bool),
            advantages=zeros,
            inference_logprobs=zeros.clone(),
            temperatures=torch.from_numpy(layout.temperatures),
            teacher_logprobs=None,
            token_slots=torch.from_numpy(layout.token_slots),
            sample_ids=torch.from_numpy(layout.sample_ids),
            seq_lens=layout.seq_lens,
            slot_token_counts=torch.from_numpy(np.bincount(layout.token_slots, minlength=self.n_slots)),
            is_filler=True,
        )
