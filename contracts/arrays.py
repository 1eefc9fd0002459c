"""The binary form of a rollout batch: per-token fields as little-endian typed arrays in msgpack
`bytes` fields (token ids int32, masks uint8 0/1, per-token floats float32), read with
`numpy.frombuffer` so no per-token Python object exists between the socket and the Packer.

`ArrayBatch` is what the SDK sends by default, what the service stores (as received) and serves in
claims, and what the Packer reads. `TrainingBatch` (lists, contracts.wire) stays the form of JSON
bodies and of code that builds samples by hand; `to_arrays` / `to_lists` convert between the two
(once, at the edge). `array_batch_problems` checks a whole batch with a few vectorised numpy
operations; only when that check fails are the problems worded by the one definition of a
trainable sample, `contracts.wire.sample_problems`, on the list form of the batch — so a binary
body and a JSON body with the same fault get the same 422. Torch-free.
"""

import contextlib
import struct
from collections.abc import Callable, Iterable
from typing import Any, cast

import msgspec
import numpy as np
import numpy.typing as npt

from contracts.wire import (
    MAX_ABS_SCALAR,
    MAX_EXAMPLES_PER_BATCH,
    MAX_LABEL_CHARS,
    MAX_SAMPLE_METRICS,
    Problem,
    TrainingBatch,
    TrainingSample,
    batch_field_problems,
    batch_problems,
    sample_problems,
)

IDS_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
FLOAT_DTYPE = np.dtype("<f4")

MAX_TOKEN_ID = 2**31 - 1
"""Token ids travel as int32: with no known vocabulary, ids above this are refused."""

ARRAYS_CONTENT_TYPE = "application/msgpack"
"""Binary batches are msgpack bodies like the list form; the service tells them apart by their
field types (bytes against arrays)."""


class ArraySample(msgspec.Struct, forbid_unknown_fields=True):
    """`TrainingSample` with its per-token fields as little-endian typed arrays."""

    prompt_ids: bytes
    """int32 little-endian."""
    prompt_mask: bytes
    """uint8, 0 or 1."""
    completion_ids: bytes
    """int32 little-endian."""
    completion_mask: bytes
    """uint8, 0 or 1; 0 on completion tokens that carry no loss."""
    completion_logprobs: bytes
    """float32 little-endian."""
    advantage: float | bytes | None = None
    """A scalar, or float32 little-endian per completion token."""
    teacher_logprobs: bytes | None = None
    reward: float | None = None
    token_rewards: bytes | None = None
    weights: bytes | None = None
    metrics: dict[str, float] | None = None


class ArrayBatch(msgspec.Struct, forbid_unknown_fields=True):
    """`TrainingBatch` with `ArraySample`s."""

    examples: list[ArraySample]
    temperature: float = 1.0
    step: int = 0
    env: str | None = None
    agent: str | None = None


array_batch_encoder = msgspec.msgpack.Encoder()
array_batch_decoder = msgspec.msgpack.Decoder(ArrayBatch)

# The per-token fields, their dtype, and the ids field whose length they must have.
_PER_TOKEN: tuple[tuple[str, np.dtype, str], ...] = (
    ("prompt_ids", IDS_DTYPE, "prompt_ids"),
    ("prompt_mask", MASK_DTYPE, "prompt_ids"),
    ("completion_ids", IDS_DTYPE, "completion_ids"),
    ("completion_mask", MASK_DTYPE, "completion_ids"),
    ("completion_logprobs", FLOAT_DTYPE, "completion_ids"),
    ("advantage", FLOAT_DTYPE, "completion_ids"),
    ("teacher_logprobs", FLOAT_DTYPE, "completion_ids"),
    ("token_rewards", FLOAT_DTYPE, "completion_ids"),
    ("weights", FLOAT_DTYPE, "completion_ids"),
)


# --------------------------------------------------------------------------- conversions


class NoBinaryForm(ValueError):
    """A list batch that has no binary form: a token id or mask value that is no integer or does
    not fit its type. Names the sample and the field, as the service's 422 would."""

    def __init__(self, index: int, field: str, problem: str) -> None:
        super().__init__(f"sample {index}: {field} {problem}")
        self.index, self.field, self.problem = index, field, problem


def _whole(values: object, dtype: np.dtype, what: str) -> bytes:
    """Integers (a list of numpy scalars, an array, a tuple) as ``dtype``, refused rather than
    wrapped or truncated when a value is no integer or does not fit."""
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:  # ragged, or objects numpy cannot hold
        raise ValueError(f"must hold {what} ({exc})") from None
    if array.size and array.dtype.kind not in "biu":
        raise ValueError(f"must hold {what}: integers, not {array.dtype}")
    info = np.iinfo(dtype)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise ValueError(f"must hold {what} in [{info.min}, {info.max}]")
    return array.astype(dtype).tobytes()


def _ints(values: list[int]) -> bytes:
    if type(values) is list:
        with contextlib.suppress(struct.error, TypeError):
            # struct packs a list of Python ints 4x faster than numpy converts it (each element
            # is read by its C type; no intermediate array). What it refuses (a float, a value
            # beyond int32) is refused below too; numpy integer scalars pass there.
            return struct.pack(f"<{len(values)}i", *values)
    return _whole(values, IDS_DTYPE, "token ids")


def _mask(values: list[bool]) -> bytes:
    if type(values) is list:
        with contextlib.suppress(TypeError, ValueError):
            return bytes(values)  # bools and small ints as uint8, 3x faster than numpy
    return _whole(values, MASK_DTYPE, "booleans")


def _floats(values: list[float]) -> bytes:
    if type(values) is list:
        try:
            # The same round-to-nearest cast to float32 as numpy's; a finite value beyond float32
            # raises here (numpy gives inf, which the service refuses by name), so fall back.
            return struct.pack(f"<{len(values)}f", *values)
        except (struct.error, TypeError, OverflowError):
            pass
    return np.asarray(values, dtype=FLOAT_DTYPE).tobytes()


def _opt_floats(values: list[float] | None) -> bytes | None:
    return None if values is None else _floats(values)


_CONVERSIONS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("prompt_ids", _ints),
    ("prompt_mask", _mask),
    ("completion_ids", _ints),
    ("completion_mask", _mask),
    ("completion_logprobs", _floats),
    ("advantage", lambda v: _floats(v) if isinstance(v, list) else v),
    ("teacher_logprobs", _opt_floats),
    ("token_rewards", _opt_floats),
    ("weights", _opt_floats),
)


def _sample_arrays(index: int, s: TrainingSample) -> ArraySample:
    converted: dict[str, Any] = {}
    for name, convert in _CONVERSIONS:
        try:
            converted[name] = convert(getattr(s, name))
        except (ValueError, TypeError) as exc:
            raise NoBinaryForm(index, name, str(exc)) from None
    return ArraySample(**converted, reward=s.reward, metrics=s.metrics)


def to_arrays(batch: TrainingBatch) -> ArrayBatch:
    """The binary form of a list batch. Raises `NoBinaryForm` (a ValueError naming the sample and
    field) when a token id or mask value is no integer or does not fit int32 / uint8; every other
    rule is the service's to check (`array_batch_problems`)."""
    return ArrayBatch(
        examples=[_sample_arrays(i, s) for i, s in enumerate(batch.examples)],
        temperature=batch.temperature,
        step=batch.step,
        env=batch.env,
        agent=batch.agent,
    )


def _floats_list(data: bytes) -> list[float]:
    return cast(list[float], np.frombuffer(data, dtype=FLOAT_DTYPE).tolist())


def _opt_floats_list(data: bytes | None) -> list[float] | None:
    return None if data is None else _floats_list(data)


def sample_to_lists(s: ArraySample) -> TrainingSample:
    """The list form of one (well-aligned) binary sample."""
    return TrainingSample(
        prompt_ids=cast(list[int], np.frombuffer(s.prompt_ids, dtype=IDS_DTYPE).tolist()),
        prompt_mask=(np.frombuffer(s.prompt_mask, dtype=MASK_DTYPE) != 0).tolist(),
        completion_ids=cast(list[int], np.frombuffer(s.completion_ids, dtype=IDS_DTYPE).tolist()),
        completion_mask=(np.frombuffer(s.completion_mask, dtype=MASK_DTYPE) != 0).tolist(),
        completion_logprobs=_floats_list(s.completion_logprobs),
        advantage=_floats_list(s.advantage) if isinstance(s.advantage, bytes) else s.advantage,
        teacher_logprobs=_opt_floats_list(s.teacher_logprobs),
        reward=s.reward,
        token_rewards=_opt_floats_list(s.token_rewards),
        weights=_opt_floats_list(s.weights),
        metrics=s.metrics,
    )


def to_lists(batch: ArrayBatch) -> TrainingBatch:
    """The list form of a (well-aligned) binary batch: for JSON answers and for wording problems."""
    return TrainingBatch(
        examples=[sample_to_lists(s) for s in batch.examples],
        temperature=batch.temperature,
        step=batch.step,
        env=batch.env,
        agent=batch.agent,
    )


def decode_stored(data: bytes) -> ArrayBatch:
    """A stored payload or claimed batch: the binary form, or (payloads stored before the binary
    form existed) the list form, converted."""
    try:
        return array_batch_decoder.decode(data)
    except msgspec.ValidationError:
        return to_arrays(msgspec.msgpack.decode(data, type=TrainingBatch))


# --------------------------------------------------------------------------- validation


def _byte_problems(batch: ArrayBatch) -> list[Problem]:
    """What only the binary form can get wrong: a field whose byte count is not a whole number of
    elements, and masks with values other than 0 and 1."""
    out: list[Problem] = []
    for index, s in enumerate(batch.examples):
        for name, dtype, _of in _PER_TOKEN:
            data = getattr(s, name)
            if isinstance(data, bytes) and len(data) % dtype.itemsize:
                out.append(
                    Problem(
                        index,
                        name,
                        f"{name} has {len(data)} bytes, not a whole number of {dtype.itemsize}-byte "
                        f"{dtype.name} little-endian values",
                    )
                )
    if out:
        return out
    for name in ("prompt_mask", "completion_mask"):
        values = np.frombuffer(b"".join(getattr(s, name) for s in batch.examples), dtype=MASK_DTYPE)
        if values.size and int(values.max()) > 1:
            out += _first_bad_mask(batch, name)
    return out


def _first_bad_mask(batch: ArrayBatch, name: str) -> list[Problem]:
    for index, s in enumerate(batch.examples):
        values = np.frombuffer(getattr(s, name), dtype=MASK_DTYPE)
        bad = np.flatnonzero(values > 1)
        if bad.size:
            pos = int(bad[0])
            return [Problem(index, name, f"{name} value {int(values[pos])} at position {pos} is not 0 or 1")]
    return []  # pragma: no cover - the caller saw a value > 1


def _joined(batch: ArrayBatch, name: str, dtype: np.dtype) -> npt.NDArray[np.generic]:
    parts: Iterable[bytes] = (d for s in batch.examples if isinstance(d := getattr(s, name), bytes))
    return np.frombuffer(b"".join(parts), dtype=dtype)


def _all_finite(values: npt.NDArray[np.generic]) -> bool:
    # sum is one pass and no temporary array; a NaN/inf anywhere (or an overflow of huge finite
    # values, which the exact check then clears) makes it non-finite.
    return bool(np.isfinite(values.sum(dtype=np.float64))) or bool(np.isfinite(values).all())


class _Parts:
    """A batch's per-token bytes gathered by the kind of check they get (see `_trainable`)."""

    __slots__ = ("bounded", "floats", "ids", "logprobs", "masks", "scalars", "weights")

    def __init__(self) -> None:
        self.ids: list[bytes] = []  # in [0, limit)
        self.masks: list[bytes] = []  # 0 or 1
        self.floats: list[bytes] = []  # advantage, token_rewards: finite
        self.weights: list[bytes] = []  # finite and >= 0
        self.logprobs: list[bytes] = []  # finite and <= 0 (full checks only)
        self.scalars: list[float] = []  # finite
        self.bounded: list[float] = []  # rewards, metric values: finite, |x| <= MAX_ABS_SCALAR


def _gather(s: ArraySample, parts: _Parts, *, seq_len: int, full: bool) -> bool:
    """The length rules of one sample (with the byte rules of `_byte_problems`); its bytes into `parts`."""
    prompt, completion = s.prompt_ids, s.completion_ids
    n_prompt, n_completion = len(prompt) >> 2, len(completion) >> 2
    if (
        len(prompt) & 3
        or len(completion) & 3
        or not 0 < n_prompt + n_completion <= seq_len
        or (full and (n_prompt == 0 or n_completion == 0))
    ):
        return False
    width = n_completion << 2
    if (
        len(s.prompt_mask) != n_prompt
        or len(s.completion_mask) != n_completion
        or len(s.completion_logprobs) != width
        or s.advantage is None
    ):
        return False
    if isinstance(s.advantage, bytes):
        if len(s.advantage) != width:
            return False
        parts.floats.append(s.advantage)
    else:
        parts.scalars.append(s.advantage)
    for extra, into in (
        (s.teacher_logprobs, parts.logprobs),
        (s.token_rewards, parts.floats),
        (s.weights, parts.weights),
    ):
        if extra is not None:
            if len(extra) != width:
                return False
            into.append(extra)
    if s.reward is not None:
        parts.bounded.append(s.reward)
    if s.metrics:
        if not _metrics_fit(s.metrics):
            return False
        parts.bounded += s.metrics.values()
    parts.ids += (prompt, completion)
    parts.masks += (s.prompt_mask, s.completion_mask)
    parts.logprobs.append(s.completion_logprobs)
    return True


def _metrics_fit(metrics: dict[str, float]) -> bool:
    return len(metrics) <= MAX_SAMPLE_METRICS and all(
        name and len(name) <= MAX_LABEL_CHARS and "\x00" not in name for name in metrics
    )


def _within(
    data: list[bytes], dtype: np.dtype, *, low: float | None = None, high: float | None = None
) -> bool:
    """Every value finite (floats) and within [low, high]."""
    values = np.frombuffer(b"".join(data), dtype=dtype)
    if not values.size:
        return True
    if dtype.kind == "f" and not _all_finite(values):
        return False
    return (low is None or float(values.min()) >= low) and (high is None or float(values.max()) <= high)


def _bounded(values: list[float]) -> bool:
    """Every value finite and within ±MAX_ABS_SCALAR (NaN fails the comparison)."""
    magnitudes = np.abs(np.asarray(values, dtype=np.float64))
    return bool((magnitudes <= MAX_ABS_SCALAR).all())


def _trainable(batch: ArrayBatch, *, seq_len: int, vocab_size: int | None, full: bool) -> bool:
    """True only when the batch breaks no rule of `sample_problems` (with ``full``) and no byte rule of
    the binary form: the length rules in one pass over the samples, then one join and one numpy
    reduction per kind of value (a good batch, the common case, costs a few reductions; the three
    separate checks it replaced cost about twice as much). False says only "look closer"."""
    parts = _Parts()
    if not all(_gather(s, parts, seq_len=seq_len, full=full) for s in batch.examples):
        return False
    limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    return (
        _within(parts.masks, MASK_DTYPE, high=1)
        and _within(parts.ids, IDS_DTYPE, low=0, high=limit - 1)
        and _within(parts.floats, FLOAT_DTYPE)
        and _within(parts.weights, FLOAT_DTYPE, low=0.0)
        and (not parts.scalars or _all_finite(np.asarray(parts.scalars, dtype=np.float64)))
        and (not parts.bounded or _bounded(parts.bounded))
        and (not full or _within(parts.logprobs, FLOAT_DTYPE, high=0.0))
    )


def array_batch_problems(
    batch: ArrayBatch, *, seq_len: int, vocab_size: int | None, full: bool = True
) -> list[Problem]:
    """Every rule `batch` breaks (the rules of `contracts.wire.batch_problems`, plus the byte rules of
    the binary form); empty when it can be trained.

    The common case (a good batch) costs a few numpy reductions over the whole batch; the problems
    of a bad one are worded by `sample_problems` on its list form, as for a JSON body.
    """
    out = batch_field_problems(cast(TrainingBatch, batch))  # reads only the batch-level fields
    if not out and _trainable(batch, seq_len=seq_len, vocab_size=vocab_size, full=full):
        return []
    if out and not 0 < len(batch.examples) <= MAX_EXAMPLES_PER_BATCH:
        return out
    bytes_wrong = _byte_problems(batch)
    if bytes_wrong:
        return out + bytes_wrong
    # `_trainable` said "look closer": the one definition of the rules words what is wrong (or, for
    # a batch it refused only out of caution, finds nothing).
    lists = to_lists(batch)
    limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size
    if full:
        return batch_problems(lists, seq_len=seq_len, vocab_size=limit)
    problems = list(out)
    for index, sample in enumerate(lists.examples):
        problems += [
            Problem(index, field, problem)
            for field, problem in sample_problems(sample, seq_len=seq_len, vocab_size=limit, full=False)
        ]
    return problems


# --------------------------------------------------------------------------- helpers


def num_tokens(batch: ArrayBatch) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.examples) >> 2


def encode(batch: ArrayBatch) -> bytes:
    """The canonical bytes of a binary batch (what the SDK sends and the service stores for a JSON body)."""
    return array_batch_encoder.encode(batch)
