"""The Packer's per-run buffers, struct-of-arrays: one `SampleChunk` per added batch (flat arrays of
all its samples' tokens plus offset tables), and no Python object per sample.

A per-sample object with its own array views cost ~20 µs a sample (10k-sample batches spend more in
that bookkeeping than in the tokens); here a batch costs one ``b"".join`` + ``frombuffer`` per field
and a few vectorised operations over per-sample length arrays, and a sample is just an index into its
chunk. `RowFormat.build` then reads members as ``(chunk, index)`` slices of the flat arrays.

`SampleChunk.from_arrays` also checks the Packer's rules (``contracts.wire.sample_problems`` with
``full=False``) on the joined arrays, so the bytes are walked once for checking and buffering; a
batch that fails is re-checked by ``contracts.arrays.array_batch_problems``, the one wording of the
rules, which names the sample and the problem.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from contracts.arrays import FLOAT_DTYPE, IDS_DTYPE, MAX_TOKEN_ID, ArraySample
from contracts.wire import MAX_LABEL_CHARS, MAX_SAMPLE_METRICS

__all__ = ["RunBuffer", "SampleChunk"]

_F32 = np.float32


@dataclass(slots=True)
class SampleChunk:
    """The buffered samples of one added batch (those from ``first_index`` on), as flat arrays.

    With ``t0, t1, c0, c1, n_prompt = spans[k]``, sample ``k``'s tokens are ``ids[t0:t1]`` (prompt
    first, ``n_prompt`` of them) and its completion fields ``[c0:c1]`` of the completion-aligned arrays.
    """

    batch_id: int
    first_index: int
    """Index in the batch of sample 0 (the ``skip`` of `Packer.add_batch`)."""
    temperature: float
    arrived_at: float
    """Packer clock when the batch was added (for the timeout)."""
    ids: npt.NDArray[np.int32]
    """(T,) every sample's prompt then completion ids, samples end to end."""
    spans: list[tuple[int, int, int, int, int]]
    """Per sample: (first token, end token, first completion token, end completion token, prompt
    length); Python ints, because a row reads them one sample at a time."""
    num_tokens: int
    lengths: list[int]
    """Tokens per sample."""
    loss_tokens: list[int]
    """Tokens per sample that carry loss in a row (completion_mask, minus a sample-initial token)."""
    completion_mask: npt.NDArray[np.bool_]
    """(C,)"""
    logprobs: npt.NDArray[np.float32]
    """(C,) the inference policy's logprobs."""
    advantage_scalars: list[float] | None
    """(N,) float32 values when every sample's advantage is a scalar; else None and
    ``advantage_tokens`` is set."""
    advantage_tokens: npt.NDArray[np.float32] | None
    """(C,) per-token advantages (scalars broadcast) when any sample has per-token ones."""
    teacher: npt.NDArray[np.float32] | None
    """(C,) teacher logprobs, 0 for samples without; None when no sample has any."""
    has_teacher: list[bool] | None
    weights: npt.NDArray[np.float32] | None
    """(C,) loss weights, the completion mask (as 0/1) for samples without; None when none has any."""
    has_weights: list[bool] | None
    rewards: npt.NDArray[np.float32] | None
    """(C,) GAE rewards: ``token_rewards``, or ``reward`` on the sample's last loss-carrying
    completion token (the last completion token when none carries loss); 0 for samples without."""
    has_rewards: list[bool] | None
    plain: bool
    """Scalar advantages and no teacher logprobs, weights or rewards: rows take the short path."""

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def from_arrays(
        cls,
        examples: Sequence[ArraySample],
        *,
        skip: int,
        batch_id: int,
        temperature: float,
        arrived_at: float,
        seq_len: int,
        vocab_size: int | None,
    ) -> SampleChunk | None:
        """The samples ``examples[skip:]`` as a chunk; None when any sample of ``examples`` (the
        skipped ones too) may break a rule of ``sample_problems(full=False)`` (then ask
        ``array_batch_problems`` which). ``examples[skip:]`` must not be empty."""
        joined = _Joined.checked(examples, seq_len=seq_len, vocab_size=vocab_size)
        if joined is None:
            return None
        # Offsets of the kept samples, relative to their first token / completion token.
        token_starts = np.concatenate(([0], np.cumsum(joined.lengths))).tolist()
        completion_starts = np.concatenate(([0], np.cumsum(joined.n_completion))).tolist()
        t0, c0, c1 = token_starts[skip], completion_starts[skip], completion_starts[-1]
        kept_t = [t - t0 for t in token_starts[skip:]]
        kept_c = [c - c0 for c in completion_starts[skip:]]
        kept_n_prompt = joined.n_prompt[skip:]
        completion_mask = joined.completion_mask[c0:]
        loss_tokens = _per_sample_sums(completion_mask, kept_c)
        # The first token of a sample with no prompt has no in-sample predecessor: never loss.
        empty_prompt = np.flatnonzero(kept_n_prompt == 0)
        if empty_prompt.size:
            loss_tokens[empty_prompt] -= completion_mask[np.asarray(kept_c)[empty_prompt]]
        kept = examples[skip:]
        has_teacher = _flags(kept, "teacher_logprobs")
        has_weights = _flags(kept, "weights")
        rewards, has_rewards = _rewards(kept, joined, c0, c1)
        adv_scalars, adv_tokens = joined.advantages
        return cls(
            batch_id=batch_id,
            first_index=skip,
            temperature=temperature,
            arrived_at=arrived_at,
            ids=joined.ids[t0:],
            spans=list(
                zip(kept_t[:-1], kept_t[1:], kept_c[:-1], kept_c[1:], kept_n_prompt.tolist(), strict=True)
            ),
            num_tokens=kept_t[-1],
            lengths=joined.lengths[skip:].tolist(),
            loss_tokens=loss_tokens.tolist(),
            completion_mask=completion_mask,
            logprobs=joined.logprobs[c0:],
            advantage_scalars=None if adv_scalars is None else adv_scalars[skip:].tolist(),
            advantage_tokens=None if adv_tokens is None else adv_tokens[c0:],
            teacher=None if has_teacher is None else joined.filled("teacher_logprobs", examples, 0.0)[c0:],
            has_teacher=has_teacher,
            weights=None if has_weights is None else joined.filled("weights", examples, None)[c0:],
            has_weights=has_weights,
            rewards=rewards,
            has_rewards=has_rewards,
            plain=adv_tokens is None and has_teacher is None and has_weights is None and has_rewards is None,
        )


@dataclass(frozen=True, slots=True)
class _Joined:
    """A whole batch as joined arrays (one ``b"".join`` + ``frombuffer`` per field), checked."""

    n_prompt: npt.NDArray[np.int64]
    n_completion: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    ids: npt.NDArray[np.int32]
    completion_mask: npt.NDArray[np.bool_]
    logprobs: npt.NDArray[np.float32]
    advantages: tuple[npt.NDArray[np.float32] | None, npt.NDArray[np.float32] | None]
    optional: dict[str, npt.NDArray[np.float32] | None]
    """teacher_logprobs, token_rewards, weights: the values of the samples that have them, end to end."""

    @classmethod
    def checked(
        cls, examples: Sequence[ArraySample], *, seq_len: int, vocab_size: int | None
    ) -> _Joined | None:
        """The joined arrays; None when a rule of ``sample_problems(full=False)`` may be broken."""
        n = len(examples)
        n_prompt_bytes = np.fromiter((len(s.prompt_ids) for s in examples), np.int64, n)
        n_completion_bytes = np.fromiter((len(s.completion_ids) for s in examples), np.int64, n)
        if (n_prompt_bytes % 4).any() or (n_completion_bytes % 4).any():
            return None
        n_prompt, n_completion = n_prompt_bytes >> 2, n_completion_bytes >> 2
        lengths = n_prompt + n_completion
        if int(lengths.min()) < 1 or int(lengths.max()) > seq_len:
            return None
        if not _per_sample_fields_ok(examples, n_prompt, n_completion):
            return None
        optional: dict[str, npt.NDArray[np.float32] | None] = {}
        for name in ("teacher_logprobs", "token_rewards", "weights"):
            fits, optional[name] = _optional_floats(examples, name, n_completion_bytes)
            if not fits:
                return None
        advantages = _advantages(examples, n_completion)
        if advantages is None or not _scalars_finite(examples):
            return None
        for values in (advantages[1], optional["token_rewards"], optional["weights"]):
            if values is not None and not _all_finite(values):
                return None
        weights = optional["weights"]
        if weights is not None and weights.size and float(weights.min()) < 0.0:
            return None
        ids = np.frombuffer(
            b"".join(p for s in examples for p in (s.prompt_ids, s.completion_ids)), IDS_DTYPE
        )
        limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limit):
            return None
        mask = np.frombuffer(b"".join(s.completion_mask for s in examples), np.uint8)
        prompt_mask = np.frombuffer(b"".join(s.prompt_mask for s in examples), np.uint8)
        if (mask.size and int(mask.max()) > 1) or (prompt_mask.size and int(prompt_mask.max()) > 1):
            return None
        return cls(
            n_prompt=n_prompt,
            n_completion=n_completion,
            lengths=lengths,
            ids=ids,
            completion_mask=mask.view(np.bool_),
            logprobs=np.frombuffer(b"".join(s.completion_logprobs for s in examples), FLOAT_DTYPE),
            advantages=advantages,
            optional=optional,
        )

    def filled(
        self, name: str, examples: Sequence[ArraySample], fill: float | None
    ) -> npt.NDArray[np.float32]:
        """(C,) the optional field ``name`` at every sample's completion positions; for samples
        without it ``fill``, or (None) their completion mask as 0/1 (the implicit loss weights)."""
        joined = self.optional[name]
        assert joined is not None
        present = [getattr(s, name) is not None for s in examples]
        if all(present):
            return joined
        is_present = np.repeat(np.asarray(present, dtype=np.bool_), self.n_completion)
        out = (
            self.completion_mask.astype(np.float32)
            if fill is None
            else np.full(is_present.shape[0], fill, _F32)
        )
        out[is_present] = joined
        return out


def _per_sample_sums(mask: npt.NDArray[np.bool_], starts: list[int]) -> npt.NDArray[np.int64]:
    """(N,) True values of ``mask`` in each ``[starts[k], starts[k + 1])`` (``starts[-1]`` = the end).

    ``np.add.reduceat`` over the non-empty segments (an empty one would read its neighbour's first
    value); 20x faster than a cumulative sum of the whole mask.
    """
    bounds = np.asarray(starts, dtype=np.int64)
    out = np.zeros(len(starts) - 1, dtype=np.int64)
    non_empty = np.flatnonzero(bounds[1:] > bounds[:-1])
    if non_empty.size:
        out[non_empty] = np.add.reduceat(mask.view(np.uint8), bounds[non_empty], dtype=np.int64)
    return out


def _per_sample_fields_ok(
    examples: Sequence[ArraySample], n_prompt: npt.NDArray[np.int64], n_completion: npt.NDArray[np.int64]
) -> bool:
    """Masks and logprobs as long as their ids, an advantage present, metrics within bounds."""
    n = len(examples)
    prompt_mask = np.fromiter((len(s.prompt_mask) for s in examples), np.int64, n)
    completion_mask = np.fromiter((len(s.completion_mask) for s in examples), np.int64, n)
    logprobs = np.fromiter((len(s.completion_logprobs) for s in examples), np.int64, n)
    if (
        (prompt_mask != n_prompt).any()
        or (completion_mask != n_completion).any()
        or (logprobs != 4 * n_completion).any()
    ):
        return False
    for s in examples:
        if s.advantage is None:
            return False
        if s.metrics and (
            len(s.metrics) > MAX_SAMPLE_METRICS
            or any(not name or len(name) > MAX_LABEL_CHARS for name in s.metrics)
        ):
            return False
    return True


def _optional_floats(
    examples: Sequence[ArraySample], name: str, c_bytes: npt.NDArray[np.int64]
) -> tuple[bool, npt.NDArray[np.float32] | None]:
    """(every present value has its sample's byte count, the joined float32 values of an optional
    per-completion-token field over the samples that have it, None when none has it)."""
    values = [getattr(s, name) for s in examples]
    present = [k for k, v in enumerate(values) if v is not None]
    if not present:
        return True, None
    if any(len(values[k]) != c_bytes[k] for k in present):
        return False, None
    return True, np.frombuffer(b"".join(values[k] for k in present), FLOAT_DTYPE)


def _advantages(
    examples: Sequence[ArraySample], n_completion: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.float32] | None, npt.NDArray[np.float32] | None] | None:
    """(scalars (N,), None) when every advantage is a scalar; (None, per-token (C,) with scalars
    broadcast) otherwise; None when a per-token one has the wrong byte count."""
    values = [s.advantage for s in examples]
    if all(isinstance(v, float) for v in values):
        return np.asarray(values, dtype=_F32), None
    pieces = []
    for v, n in zip(values, n_completion.tolist(), strict=True):
        if isinstance(v, float):
            pieces.append(np.full(n, v, _F32))
        else:
            assert v is not None  # checked by _per_sample_fields_ok
            if len(v) != 4 * n:
                return None
            pieces.append(np.frombuffer(v, FLOAT_DTYPE))
    return None, np.concatenate(pieces) if pieces else np.zeros(0, _F32)


def _all_finite(values: npt.NDArray[np.float32]) -> bool:
    # One pass, no temporary; an overflow of huge finite values is cleared by the exact check.
    return bool(np.isfinite(values.sum(dtype=np.float64))) or bool(np.isfinite(values).all())


def _scalars_finite(examples: Sequence[ArraySample]) -> bool:
    scalars: list[float] = [s.advantage for s in examples if isinstance(s.advantage, float)]
    scalars += [s.reward for s in examples if s.reward is not None]
    for s in examples:
        if s.metrics:
            scalars += s.metrics.values()
    return all(math.isfinite(v) for v in scalars)


def _flags(kept: Sequence[ArraySample], name: str) -> list[bool] | None:
    flags = [getattr(s, name) is not None for s in kept]
    return flags if any(flags) else None


def _rewards(
    kept: Sequence[ArraySample], joined: _Joined, c0: int, c1: int
) -> tuple[npt.NDArray[np.float32] | None, list[bool] | None]:
    """``rewards`` and ``has_rewards`` of the chunk of ``kept`` (see `SampleChunk.rewards`)."""
    kept_n_completion = joined.n_completion[len(joined.n_completion) - len(kept) :].tolist()
    has = [
        s.token_rewards is not None or (s.reward is not None and n > 0)
        for s, n in zip(kept, kept_n_completion, strict=True)
    ]
    if not any(has):
        return None, None
    # Per sample: rewards are rare enough (GAE runs) that a loop over the batch costs nothing.
    out = np.zeros(c1 - c0, _F32)
    start = 0
    for s, n in zip(kept, kept_n_completion, strict=True):
        if s.token_rewards is not None:
            out[start : start + n] = np.frombuffer(s.token_rewards, FLOAT_DTYPE)
        elif s.reward is not None and n > 0:
            carrying = np.flatnonzero(joined.completion_mask[c0 + start : c0 + start + n])
            out[start + (int(carrying[-1]) if carrying.size else n - 1)] = s.reward
        start += n
    return out, has


class RunBuffer:
    """One run's buffered samples, oldest first: chunks in the order added, samples in batch order."""

    __slots__ = ("_chunks", "_head", "_samples", "tokens")

    def __init__(self) -> None:
        self._chunks: deque[SampleChunk] = deque()
        self._head = 0  # the next sample of _chunks[0]
        self._samples = 0
        self.tokens = 0
        """Sum of the buffered samples' lengths."""

    def __len__(self) -> int:
        return self._samples

    def append(self, chunk: SampleChunk) -> None:
        self._chunks.append(chunk)
        self._samples += len(chunk)
        self.tokens += chunk.num_tokens

    def head_length(self) -> int:
        """Tokens of the oldest sample (the buffer must not be empty)."""
        return self._chunks[0].lengths[self._head]

    def head_arrived_at(self) -> float:
        return self._chunks[0].arrived_at

    def pop(self) -> tuple[SampleChunk, int]:
        """Remove the oldest sample: (its chunk, its index there)."""
        chunk, k = self._chunks[0], self._head
        self._head += 1
        if self._head == len(chunk):
            self._chunks.popleft()
            self._head = 0
        self._samples -= 1
        self.tokens -= chunk.lengths[k]
        return chunk, k
