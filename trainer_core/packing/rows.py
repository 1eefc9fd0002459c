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

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer_core.packing.buffer import SampleChunk

__all__ = ["EXPANDED_VIEWS", "Member", "MicroBatch", "RowFormat", "SampleRef"]


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

    Compact by design (issue 15): only what differs token by token is stored per token, in its narrowest
    exact dtype — ``token_ids`` (int32), ``loss_mask`` (bool), ``inference_logprobs`` (float32), and the
    optional per-token fields when a sample of the row has them — 9 bytes per token for a row of plain
    samples, against 45 when every field was expanded in the Packer. Facts of a whole sample (its slot,
    temperature, scalar advantage, prompt length; positions and sample indices follow from ``seq_lens``)
    are per-segment Python lists (a ``torch.tensor`` of a short list costs ~10 µs, five per row were a
    fifth of ``pack``). The per-token views the model and the loss read (``input_ids``,
    ``position_ids``, ``advantages``, ``temperatures``, ``token_slots``, ``sample_ids``) are expanded in
    torch on first use, on whatever device the row's tensors are on (`trainer_core.step` moves the compact
    row, then expands it there), and cached on the instance; the cache is not pickled, so a row sent to
    another rank carries only the compact fields. Expanded values and dtypes are exactly what the Packer
    built before (``tests/trainer_core/test_packing_reference.py``).

    "Segments" are the entries of ``seq_lens``: the samples, then the padding pseudo-sequence if any.
    """

    token_ids: torch.Tensor
    """(L,) int32. Prompt then completion of each sample, then ``pad_token_id``."""
    loss_mask: torch.Tensor
    """(L,) bool. True on completion tokens whose ``completion_mask`` is True, except a sample's first
    token (the loss predicts token t from ``logits[t-1]``, which must lie in the same sample)."""
    inference_logprobs: torch.Tensor
    """(L,) float32. The inference policy's logprob on completion tokens; 0 elsewhere."""
    seq_lens: list[int]
    """Lengths of the samples in order, then the padding as a final pseudo-sequence (if any)."""
    n_samples: int
    """Real samples: the first ``n_samples`` segments; a further one is padding."""
    segment_slots: list[int]
    """The slot (run) of each segment; non-decreasing. Padding takes the last slot present."""
    segment_temperatures: list[float]
    """The sampling temperature of each segment's batch (float32 in the view); 1.0 for padding."""
    segment_prompt_lens: list[int]
    """Prompt tokens of each segment (the whole segment for padding)."""
    segment_advantages: list[float]
    """Each sample's scalar advantage (float32 values; 0 for padding); unused when ``token_advantages``
    is set."""
    slot_token_counts: torch.Tensor
    """(n_slots,) long. Tokens per slot in ascending slot order; padding is counted in the last slot
    present (slot 0 for an empty row), so the counts sum to L."""
    is_filler: bool = False
    """True for a filler row that only keeps ranks in step (no loss, no samples)."""
    token_advantages: torch.Tensor | None = None
    """(L,) float32 advantages on completion tokens (0 elsewhere) when a sample of the row has per-token
    advantages; None when every sample's advantage is a scalar (``segment_advantages``)."""
    teacher_logprobs: torch.Tensor | None = None
    """(L,) float32 teacher logprobs on completion tokens (0 elsewhere), or None when no sample in the row
    has any."""
    weights: torch.Tensor | None = None
    """(L,) float32 per-token loss weights of `cross_entropy` runs on completion tokens (0 elsewhere), or
    None when no sample in the row has `weights` (then the loss mask is the weight)."""
    rewards: torch.Tensor | None = None
    """(L,) float32 rewards for GAE runs on completion tokens: `token_rewards`, or the scalar `reward` on
    the sample's last loss-carrying completion token; 0 elsewhere. None when no sample has any."""

    def __getstate__(self) -> dict[str, Any]:
        # Only the compact fields travel (to other ranks); the expanded views are rebuilt on arrival.
        return {k: v for k, v in self.__dict__.items() if k not in EXPANDED_VIEWS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def num_tokens(self) -> int:
        """L, padding included."""
        return int(self.token_ids.shape[0])

    @property
    def num_samples(self) -> int:
        """Real samples in the row (``seq_lens`` minus the padding pseudo-sequence, if any)."""
        return self.n_samples

    @property
    def real_tokens(self) -> int:
        """Tokens of real samples (L minus the padding)."""
        return sum(self.seq_lens[: self.n_samples])

    @classmethod
    def without_loss(
        cls,
        token_ids: torch.Tensor,
        *,
        seq_lens: list[int],
        slots: list[int],
        n_slots: int,
        n_samples: int | None = None,
        is_filler: bool = False,
    ) -> MicroBatch:
        """A row that carries no loss (fillers, forward-only passes): ``token_ids`` (L,) split into
        segments of ``seq_lens`` with the ``slots`` given per segment; the first ``n_samples`` segments
        (default all) are samples, the rest padding. Prompt-only, temperature 1, logprobs 0."""
        length = int(token_ids.shape[0])
        return cls(
            token_ids=token_ids.to(torch.int32),
            loss_mask=torch.zeros(length, dtype=torch.bool),
            inference_logprobs=torch.zeros(length, dtype=torch.float32),
            seq_lens=list(seq_lens),
            n_samples=len(seq_lens) if n_samples is None else n_samples,
            segment_slots=list(slots),
            segment_temperatures=[1.0] * len(seq_lens),
            segment_prompt_lens=list(seq_lens),
            segment_advantages=[0.0] * len(seq_lens),
            slot_token_counts=torch.zeros(n_slots, dtype=torch.long).index_add_(
                0, torch.tensor(slots, dtype=torch.long), torch.tensor(seq_lens, dtype=torch.long)
            ),
            is_filler=is_filler,
        )

    # ---- per-token views, expanded in torch on the row's device ---------------------------------

    @functools.cached_property
    def _segment_index(self) -> torch.Tensor:
        """(L,) long: the index of each token's segment; one ``repeat_interleave``, then every per-token
        view is a gather (several times cheaper on CPU than a ``repeat_interleave`` per view)."""
        device = self.token_ids.device
        lens = torch.tensor(self.seq_lens, dtype=torch.long, device=device)  # (S,)
        index = torch.arange(len(self.seq_lens), dtype=torch.long, device=device)  # (S,)
        return torch.repeat_interleave(index, lens, output_size=self.num_tokens)

    def _per_token(
        self, per_segment: torch.Tensor | list[int] | list[float], dtype: torch.dtype
    ) -> torch.Tensor:
        """(L,) each segment's value repeated over its tokens, as ``dtype``."""
        index = self._segment_index
        values = torch.as_tensor(per_segment, dtype=dtype, device=index.device)  # (S,)
        return torch.index_select(values, 0, index)

    @functools.cached_property
    def input_ids(self) -> torch.Tensor:
        """(L,) long: ``token_ids`` widened to what embedding layers and ``gather`` index with."""
        return self.token_ids.long()

    @functools.cached_property
    def position_ids(self) -> torch.Tensor:
        """(L,) long. Restart at 0 for every sample and for the padding pseudo-sequence."""
        index = self._segment_index
        starts = torch.tensor([0, *itertools.accumulate(self.seq_lens[:-1])], device=index.device)  # (S,)
        return torch.arange(self.num_tokens, device=index.device) - self._per_token(starts, torch.long)

    @functools.cached_property
    def advantages(self) -> torch.Tensor:
        """(L,) float32. The sample's advantage on its completion tokens (scalar broadcast, or per token);
        0 elsewhere."""
        if self.token_advantages is not None:
            return self.token_advantages
        prompt = self.position_ids < self._per_token(self.segment_prompt_lens, torch.long)  # (L,)
        # A fill, not a product: exact for any value (0 × Inf would be NaN), +0.0 on prompts as before.
        return self._per_token(self.segment_advantages, torch.float32).masked_fill_(prompt, 0.0)

    @functools.cached_property
    def temperatures(self) -> torch.Tensor:
        """(L,) float32. The sampling temperature of each token's batch; 1.0 on padding."""
        return self._per_token(self.segment_temperatures, torch.float32)

    @functools.cached_property
    def token_slots(self) -> torch.Tensor:
        """(L,) long. The slot (run) of each token; non-decreasing. Padding takes the last slot present."""
        return self._per_token(self.segment_slots, torch.long)

    @functools.cached_property
    def sample_ids(self) -> torch.Tensor:
        """(L,) long. Index of the token's sample in ``seq_lens`` order; -1 on padding."""
        index = self._segment_index
        return (
            index if self.n_samples == len(self.seq_lens) else index.masked_fill(index >= self.n_samples, -1)
        )


EXPANDED_VIEWS = frozenset(
    ("_segment_index", "input_ids", "position_ids", "advantages", "temperatures", "token_slots", "sample_ids")
)
"""The cached per-token views of `MicroBatch` (instance attributes once computed; never pickled)."""


Member = tuple[int, SampleChunk, int]
"""One sample of a row: (slot, its buffered chunk, its index in the chunk)."""


@dataclass(frozen=True)
class RowFormat:
    """How rows of one pool are laid out; builds rows from buffered samples, and fillers.

    A row of plain samples writes three per-token arrays (ids, loss mask, logprobs: 9 bytes per token),
    one slice assignment per sample each, plus a few Python numbers per sample; rows with optional
    per-token fields concatenate slices for those. Memcpy-speed work per token, nothing per token in
    Python.
    """

    n_slots: int
    """``slot_token_counts`` has this length."""
    seq_len: int
    pad_to_multiple_of: int
    pad_token_id: int
    _zeros_f32: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Read-only source of zero segments of the optional fields (np.concatenate copies them).
        object.__setattr__(self, "_zeros_f32", np.zeros(self.seq_len, dtype=np.float32))

    def padded_length(self, length: int) -> int:
        """``length`` rounded up to ``pad_to_multiple_of``, never above ``seq_len``."""
        m = self.pad_to_multiple_of
        return min(-(-length // m) * m, self.seq_len)

    def build(self, members: list[Member]) -> MicroBatch:
        """Lay out one bin (members in ascending slot order) as a padded row.

        Each per-token field is allocated once at the row's exact length (so a row owns its buffers:
        pickled to another rank it sends its own tokens only) and filled by one slice assignment per
        sample; prompts and padding keep the zeros. Measured ~30 % less CPU per row than concatenating
        lists of slices (bench notes in docs/benchmarks.md)."""
        used = sum([chunk.lengths[k] for _, chunk, k in members])
        length = self.padded_length(used)
        pad = length - used
        token_ids = np.empty(length, dtype=np.int32)  # (L,)
        loss_mask = np.zeros(length, dtype=np.bool_)  # (L,)
        logprobs = np.zeros(length, dtype=np.float32)  # (L,)
        seq_lens: list[int] = []
        slots: list[int] = []
        temperatures: list[float] = []
        prompt_lens: list[int] = []
        advantages: list[float] = []  # per segment; 0.0 for padding and per-token advantages
        plain = True  # no member has per-token advantages, teacher logprobs, weights or rewards
        start = 0
        for slot, chunk, k in members:
            t0, t1, c0, c1, n_prompt = chunk.spans[k]
            end = start + t1 - t0
            token_ids[start:end] = chunk.ids[t0:t1]
            loss_mask[start + n_prompt : end] = chunk.completion_mask[c0:c1]
            logprobs[start + n_prompt : end] = chunk.logprobs[c0:c1]
            if not n_prompt:
                # A sample's first token has no in-sample predecessor: no loss even on a completion token.
                loss_mask[start] = False
            seq_lens.append(t1 - t0)
            slots.append(slot)
            temperatures.append(chunk.temperature)
            prompt_lens.append(n_prompt)
            scalars = chunk.advantage_scalars
            advantages.append(0.0 if scalars is None else scalars[k])
            plain = plain and chunk.plain
            start = end
        if pad:
            # The padding pseudo-sequence: all "prompt" (no completion token), the last slot present.
            token_ids[used:] = self.pad_token_id
            seq_lens.append(pad)
            slots.append(slots[-1])
            temperatures.append(1.0)
            prompt_lens.append(pad)
            advantages.append(0.0)
        counts = [0] * self.n_slots
        for slot, n in zip(slots, seq_lens, strict=True):
            counts[slot] += n  # the padding counts in the last slot present
        return MicroBatch(
            token_ids=torch.from_numpy(token_ids),
            loss_mask=torch.from_numpy(loss_mask),
            inference_logprobs=torch.from_numpy(logprobs),
            seq_lens=seq_lens,
            n_samples=len(members),
            segment_slots=slots,
            segment_temperatures=temperatures,
            segment_prompt_lens=prompt_lens,
            segment_advantages=advantages,
            slot_token_counts=torch.from_numpy(np.array(counts, dtype=np.int64)),
            is_filler=False,
            token_advantages=None if plain else self._advantages(members, pad),
            teacher_logprobs=None if plain else self._optional(members, pad, "teacher", "has_teacher"),
            weights=None
            if plain
            else self._optional(members, pad, "weights", "has_weights", default_to_mask=True),
            rewards=None if plain else self._optional(members, pad, "rewards", "has_rewards"),
        )

    def _advantages(self, members: list[Member], pad: int) -> torch.Tensor | None:
        """(L,) float32: each sample's advantage on its completion tokens, 0 elsewhere; None when every
        member's advantage is a scalar (then ``segment_advantages`` says it all)."""
        if all(chunk.advantage_tokens is None for _, chunk, _ in members):
            return None
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
        return torch.from_numpy(np.concatenate(pieces))

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
        return MicroBatch.without_loss(
            torch.full((length,), self.pad_token_id, dtype=torch.int32),
            seq_lens=[length],
            slots=[0],  # an empty row's padding counts in slot 0
            n_slots=self.n_slots,
            n_samples=0,
            is_filler=True,
        )
