"""The Packer's per-run buffers, struct-of-arrays: one `SampleChunk` per added batch (flat arrays of
all its samples' tokens plus offset tables), and no Python object per sample.

A per-sample object with its own array views cost ~20 µs a sample (10k-sample batches spend more in
that bookkeeping than in the tokens); here a batch costs one pass that takes its samples' fields as
columns (`_Columns`: C-level, no per-sample Python), one ``b"".join`` + ``frombuffer`` per field and a
few vectorised operations over per-sample length arrays, and a sample is just an index into its
chunk. `RowFormat.build` then reads members as ``(chunk, index)`` slices of the flat arrays.

`SampleChunk.from_arrays` also checks the Packer's rules (``contracts.wire.sample_problems`` with
``full=False``) on the joined arrays, so the bytes are walked once for checking and buffering; a
batch that fails is re-checked by ``contracts.arrays.array_batch_problems``, the one wording of the
rules, which names the sample and the problem.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, cast

import msgspec
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
        rewards: bool = True,
    ) -> SampleChunk | None:
        """The samples ``examples[skip:]`` as a chunk; None when any sample of ``examples`` (the
        skipped ones too) may break a rule of ``sample_problems(full=False)`` (then ask
        ``array_batch_problems`` which). ``examples[skip:]`` must not be empty."""
        columns = _Columns.of(examples)
        joined = _Joined.checked(columns, seq_len=seq_len, vocab_size=vocab_size)
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
        loss_tokens = _loss_token_counts(completion_mask, joined.n_completion[skip:], kept_c)
        # The first token of a sample with no prompt has no in-sample predecessor: never loss.
        empty_prompt = np.flatnonzero(kept_n_prompt == 0)
        if empty_prompt.size:
            loss_tokens[empty_prompt] -= completion_mask[np.asarray(kept_c)[empty_prompt]]
        kept = columns.kept(skip)
        n_prompt_list = kept_n_prompt.tolist()
        ids = joined.ids[t0:]
        has_teacher = _flags(kept.teacher_logprobs)
        has_weights = _flags(kept.weights)
        # Rewards only for runs that train on them (GAE); for the others they are metrics only.
        reward_values, has_rewards = _rewards(kept, joined, c0, c1) if rewards else (None, None)
        adv_scalars, adv_tokens = joined.advantages
        return cls(
            batch_id=batch_id,
            first_index=skip,
            temperature=temperature,
            arrived_at=arrived_at,
            ids=ids,
            spans=list(zip(kept_t[:-1], kept_t[1:], kept_c[:-1], kept_c[1:], n_prompt_list, strict=True)),
            num_tokens=kept_t[-1],
            lengths=joined.lengths[skip:].tolist(),
            loss_tokens=loss_tokens.tolist(),
            completion_mask=completion_mask,
            logprobs=joined.logprobs[c0:],
            advantage_scalars=None if adv_scalars is None else adv_scalars[skip:].tolist(),
            advantage_tokens=None if adv_tokens is None else adv_tokens[c0:],
            teacher=None if has_teacher is None else joined.filled("teacher_logprobs", columns, 0.0)[c0:],
            has_teacher=has_teacher,
            weights=None if has_weights is None else joined.filled("weights", columns, None)[c0:],
            has_weights=has_weights,
            rewards=reward_values,
            has_rewards=has_rewards,
            plain=adv_tokens is None and has_teacher is None and has_weights is None and has_rewards is None,
        )


class _Columns(NamedTuple):
    """A batch's samples as one tuple per field (column), taken in one C-level pass.

    Per-sample Python (a generator or a comprehension per field and rule) cost more than the
    batch's bytes themselves; a column answers most rules with C-level calls instead (``map(len,
    …)``, ``tuple.count(None)``, ``any``, ``b"".join``)."""

    prompt_ids: tuple[bytes, ...]
    prompt_mask: tuple[bytes, ...]
    completion_ids: tuple[bytes, ...]
    completion_mask: tuple[bytes, ...]
    completion_logprobs: tuple[bytes, ...]
    advantage: tuple[float | bytes | None, ...]
    teacher_logprobs: tuple[bytes | None, ...]
    reward: tuple[float | None, ...]
    token_rewards: tuple[bytes | None, ...]
    weights: tuple[bytes | None, ...]
    metrics: tuple[dict[str, float] | None, ...]

    @classmethod
    def of(cls, examples: Sequence[ArraySample]) -> _Columns:
        # astuple reads a struct's slots in C: half the cost of an attrgetter of the same fields.
        return cls._make(zip(*map(msgspec.structs.astuple, examples), strict=True))

    def kept(self, skip: int) -> _Columns:
        """The columns of the samples from ``skip`` on."""
        return self if not skip else _Columns._make(column[skip:] for column in self)


# astuple gives ArraySample's fields in declaration order: the columns must be those fields.
assert _Columns._fields == ArraySample.__struct_fields__, "_Columns must list ArraySample's fields in order"


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
    def checked(cls, columns: _Columns, *, seq_len: int, vocab_size: int | None) -> _Joined | None:
        """The joined arrays; None when a rule of ``sample_problems(full=False)`` may be broken."""
        n_prompt_bytes = _byte_counts(columns.prompt_ids)
        n_completion_bytes = _byte_counts(columns.completion_ids)
        if ((n_prompt_bytes | n_completion_bytes) & 3).any():
            return None
        n_prompt, n_completion = n_prompt_bytes >> 2, n_completion_bytes >> 2
        lengths = n_prompt + n_completion
        if int(lengths.min()) < 1 or int(lengths.max()) > seq_len:
            return None
        if not _per_sample_fields_ok(columns, n_prompt, n_completion):
            return None
        optional: dict[str, npt.NDArray[np.float32] | None] = {}
        for name in ("teacher_logprobs", "token_rewards", "weights"):
            fits, optional[name] = _optional_floats(getattr(columns, name), n_completion_bytes)
            if not fits:
                return None
        advantages = _advantages(columns.advantage, n_completion)
        if advantages is None or not _scalars_finite(columns, advantages[0]):
            return None
        for values in (advantages[1], optional["token_rewards"], optional["weights"]):
            if values is not None and not _all_finite(values):
                return None
        weights = optional["weights"]
        if weights is not None and weights.size and float(weights.min()) < 0.0:
            return None
        ids = np.frombuffer(
            b"".join(
                itertools.chain.from_iterable(zip(columns.prompt_ids, columns.completion_ids, strict=True))
            ),
            IDS_DTYPE,
        )
        limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
        # One pass for both bounds: a negative id read as uint32 is ≥ 2³¹ ≥ limit.
        if ids.size and int(ids.view(np.uint32).max()) >= limit:
            return None
        mask = np.frombuffer(b"".join(columns.completion_mask), np.uint8)
        prompt_mask = np.frombuffer(b"".join(columns.prompt_mask), np.uint8)
        if (mask.size and int(mask.max()) > 1) or (prompt_mask.size and int(prompt_mask.max()) > 1):
            return None
        return cls(
            n_prompt=n_prompt,
            n_completion=n_completion,
            lengths=lengths,
            ids=ids,
            completion_mask=mask.view(np.bool_),
            logprobs=np.frombuffer(b"".join(columns.completion_logprobs), FLOAT_DTYPE),
            advantages=advantages,
            optional=optional,
        )

    def filled(self, name: str, columns: _Columns, fill: float | None) -> npt.NDArray[np.float32]:
        """(C,) the optional field ``name`` at every sample's completion positions; for samples
        without it ``fill``, or (None) their completion mask as 0/1 (the implicit loss weights)."""
        joined = self.optional[name]
        assert joined is not None
        column = getattr(columns, name)
        if None not in column:
            return joined
        present = [v is not None for v in column]
        is_present = np.repeat(np.asarray(present, dtype=np.bool_), self.n_completion)
        out = (
            self.completion_mask.astype(np.float32)
            if fill is None
            else np.full(is_present.shape[0], fill, _F32)
        )
        out[is_present] = joined
        return out


def _after_prompt_zeros(completion: tuple[bytes, ...], n_prompt: list[int], itemsize: int) -> bytes:
    """A per-completion-token field made token-aligned: each sample's ``n_prompt`` zero values, then
    its completion values, samples end to end — one ``b"".join`` of memoryview slices (no per-sample
    allocation)."""
    zeros = memoryview(bytes(itemsize * max(n_prompt, default=0)))
    prompts = map(zeros.__getitem__, map(slice, [itemsize * n for n in n_prompt]))
    return b"".join(itertools.chain.from_iterable(zip(prompts, completion, strict=True)))


def _byte_counts(column: tuple[bytes, ...]) -> npt.NDArray[np.int64]:
    return np.fromiter(map(len, column), np.int64, len(column))


def _loss_token_counts(
    mask: npt.NDArray[np.bool_], n_completion: npt.NDArray[np.int64], starts: list[int]
) -> npt.NDArray[np.int64]:
    """(N,) True values of ``mask`` per sample (sample ``k``'s completion is ``[starts[k],
    starts[k + 1])``). A mask without a False — the common case — needs one counting pass; a few
    Falses are located and subtracted; a mask full of holes is summed per sample."""
    falses = mask.size - int(np.count_nonzero(mask))
    if not falses:
        return n_completion.copy()
    if falses * 16 <= mask.size:
        at = np.flatnonzero(~mask)  # (falses,)
        owner = np.searchsorted(np.asarray(starts, dtype=np.int64), at, side="right") - 1
        return n_completion - np.bincount(owner, minlength=n_completion.shape[0])
    return _per_sample_sums(mask, starts)


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
    columns: _Columns, n_prompt: npt.NDArray[np.int64], n_completion: npt.NDArray[np.int64]
) -> bool:
    """Masks and logprobs as long as their ids, an advantage present, metrics within bounds."""
    if (
        (_byte_counts(columns.prompt_mask) != n_prompt).any()
        or (_byte_counts(columns.completion_mask) != n_completion).any()
        or (_byte_counts(columns.completion_logprobs) != 4 * n_completion).any()
    ):
        return False
    if None in columns.advantage:
        return False
    if any(columns.metrics):
        for metrics in columns.metrics:
            if metrics and (
                len(metrics) > MAX_SAMPLE_METRICS
                or any(not name or len(name) > MAX_LABEL_CHARS for name in metrics)
            ):
                return False
    return True


def _optional_floats(
    column: tuple[bytes | None, ...], c_bytes: npt.NDArray[np.int64]
) -> tuple[bool, npt.NDArray[np.float32] | None]:
    """(every present value has its sample's byte count, the joined float32 values of an optional
    per-completion-token field over the samples that have it, None when none has it)."""
    if column.count(None) == len(column):
        return True, None
    present = [k for k, v in enumerate(column) if v is not None]
    if any(len(column[k]) != c_bytes[k] for k in present):  # type: ignore[arg-type]
        return False, None
    return True, np.frombuffer(b"".join(column[k] for k in present), FLOAT_DTYPE)  # type: ignore[misc]


def _advantages(
    values: tuple[float | bytes | None, ...], n_completion: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.float32] | None, npt.NDArray[np.float32] | None] | None:
    """(scalars (N,), None) when every advantage is a scalar; (None, per-token (C,) with scalars
    broadcast) otherwise; None when a per-token one has the wrong byte count."""
    if set(map(type, values)) == {float}:
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


def _scalars_finite(columns: _Columns, scalar_advantages: npt.NDArray[np.float32] | None) -> bool:
    """Scalar advantages, rewards and metric values are finite."""
    if scalar_advantages is not None:
        # float32 of a finite float64 beyond float32's range is inf: check the values as sent.
        scalars: list[float] = list(cast(tuple[float, ...], columns.advantage))
    else:
        scalars = [v for v in columns.advantage if isinstance(v, float)]
    if columns.reward.count(None) != len(columns.reward):
        scalars += [r for r in columns.reward if r is not None]
    if any(columns.metrics):
        for metrics in columns.metrics:
            if metrics:
                scalars += metrics.values()
    return _all_finite(np.asarray(scalars, dtype=np.float64)) if scalars else True


def _flags(column: tuple[object, ...]) -> list[bool] | None:
    if column.count(None) == len(column):
        return None
    return [v is not None for v in column]


def _rewards(
    kept: _Columns, joined: _Joined, c0: int, c1: int
) -> tuple[npt.NDArray[np.float32] | None, list[bool] | None]:
    """``rewards`` and ``has_rewards`` of the chunk of ``kept`` (see `SampleChunk.rewards`)."""
    if kept.token_rewards.count(None) == len(kept.token_rewards) and kept.reward.count(None) == len(
        kept.reward
    ):
        return None, None
    kept_n_completion = joined.n_completion[len(joined.n_completion) - len(kept.reward) :].tolist()
    has = [
        t is not None or (r is not None and n > 0)
        for t, r, n in zip(kept.token_rewards, kept.reward, kept_n_completion, strict=True)
    ]
    if not any(has):
        return None, None
    # Per sample: rewards are rare enough (GAE runs) that a loop over the batch costs nothing.
    out = np.zeros(c1 - c0, _F32)
    start = 0
    for t, r, n in zip(kept.token_rewards, kept.reward, kept_n_completion, strict=True):
        if t is not None:
            out[start : start + n] = np.frombuffer(t, FLOAT_DTYPE)
        elif r is not None and n > 0:
            carrying = np.flatnonzero(joined.completion_mask[c0 + start : c0 + start + n])
            out[start + (int(carrying[-1]) if carrying.size else n - 1)] = r
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

    def head_arrived_at(self) -> float:
        return self._chunks[0].arrived_at

    def lengths(self) -> Iterator[int]:
        """Tokens of every buffered sample, oldest first (lazily; do not add or take meanwhile)."""
        if not self._chunks:
            return iter(())
        first, *rest = self._chunks
        return itertools.chain(
            itertools.islice(first.lengths, self._head, None),
            itertools.chain.from_iterable(chunk.lengths for chunk in rest),
        )

    def take(self, n: int) -> list[tuple[SampleChunk, int, int]]:
        """Remove the ``n`` oldest samples (at most what is buffered): ``(chunk, first index, end
        index)`` per chunk they come from, oldest first."""
        taken: list[tuple[SampleChunk, int, int]] = []
        while n > 0 and self._chunks:
            chunk, k0 = self._chunks[0], self._head
            k1 = min(len(chunk), k0 + n)
            taken.append((chunk, k0, k1))
            self.tokens -= sum(chunk.lengths[k0:k1])
            self._samples -= k1 - k0
            n -= k1 - k0
            if k1 == len(chunk):
                self._chunks.popleft()
                self._head = 0
            else:
                self._head = k1
        return taken
