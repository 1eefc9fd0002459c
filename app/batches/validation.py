"""Decoding and validation of rollout batches (JSON or msgpack) before anything is stored.

Every rule is checked for every sample, and every problem is reported as
`{"sample": index | None, "field": name, "problem": text}`, so a client can fix a
whole batch from one 422.

Fast path: the body is decoded into subclasses of the wire structs whose number
fields carry msgspec constraints (token ids in [0, vocab_size), logprobs finite and
<= 0, advantages finite, temperature > 0, …), so the per-token checks run inside
msgspec's C decoder; only the per-sample shape rules (lengths, seq_len) are left to
Python. Ingestion throughput depends on it. When that decode fails, the body is
decoded again without constraints and every rule is checked in Python, so the 422
lists all the problems with readable messages.
"""

import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any

import msgspec

from app.errors import ValidationFailed
from trainer_core.wire import TrainingBatch, TrainingSample, batch_json_decoder, batch_msgpack_decoder

MAX_EXAMPLES_PER_BATCH = 4096
"""A cap on samples per batch; bigger rollout steps are split into several batches."""

MAX_LABEL_CHARS = 256
"""Longest `env` / `agent` label."""

MAX_REPORTED_PROBLEMS = 100
"""A 422 lists at most this many problems (a batch of 4096 broken samples is one message, not a megabyte)."""

_AT_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_SAMPLE_RE = re.compile(r"^\.examples\[(?P<index>\d+)\](?:\.(?P<field>\w+))?")
_FIELD_RE = re.compile(r"^\.(?P<field>\w+)")
_NAMED_FIELD_RE = re.compile(r"(?:unknown|required) field `(?P<field>[^`]+)`")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a batch."""

    sample: int | None
    """Index of the sample in `examples`; None for a batch-level field."""
    field: str
    """The field at fault (e.g. `completion_logprobs`, `temperature`, `body`)."""
    problem: str
    """What is wrong, in words."""

    def as_dict(self) -> dict[str, Any]:
        return {"sample": self.sample, "field": self.field, "problem": self.problem}


def reject(problems: Sequence[Problem]) -> ValidationFailed:
    """The 422 for a batch with problems (the first MAX_REPORTED_PROBLEMS of them)."""
    first = problems[0]
    where = f"sample {first.sample}, " if first.sample is not None else ""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return ValidationFailed(
        f"invalid batch: {where}{first.field}: {first.problem}{more}",
        details=[p.as_dict() for p in problems[:MAX_REPORTED_PROBLEMS]],
    )


def _problem_from_msgspec(exc: msgspec.MsgspecError) -> Problem:
    """Turn msgspec's `... - at `$.examples[3].prompt_ids[2]`` into (sample 3, field prompt_ids)."""
    text = str(exc)
    match = _AT_RE.match(text)
    message = match.group("msg") if match else text
    path = (match.group("path") if match else None) or ""
    named = _NAMED_FIELD_RE.search(message)
    sample_match = _SAMPLE_RE.match(path)
    if sample_match:
        field = sample_match.group("field") or (named.group("field") if named else "examples")
        return Problem(int(sample_match.group("index")), field, message)
    field_match = _FIELD_RE.match(path)
    if field_match:
        return Problem(None, field_match.group("field"), message)
    if named:
        return Problem(None, named.group("field"), message)
    return Problem(None, "body", message)


def decode_batch(body: bytes, *, msgpack: bool) -> TrainingBatch:
    """Decode a request body into a TrainingBatch, or raise a 422 naming the sample and field."""
    if not body:
        raise reject([Problem(None, "body", "request body is empty; expected a TrainingBatch")])
    try:
        return batch_msgpack_decoder.decode(body) if msgpack else batch_json_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise reject([_problem_from_msgspec(exc)]) from None


def _finite_floats(values: list[float]) -> int | None:
    """Index of the first NaN/inf in `values`, or None if all are finite."""
    # sum() is one C loop; a NaN or inf anywhere makes it non-finite. Only then (or on an
    # overflow of huge finite values) look for the culprit element by element.
    if math.isfinite(sum(values)):
        return None
    for i, v in enumerate(values):
        if not math.isfinite(v):
            return i
    return None


def _check_logprobs(index: int, field: str, values: list[float], out: list[Problem]) -> None:
    bad = _finite_floats(values)
    if bad is not None:
        out.append(Problem(index, field, f"value {values[bad]!r} at position {bad} is not finite"))
        return
    if values and max(values) > 0.0:
        pos = next(i for i, v in enumerate(values) if v > 0.0)
        out.append(
            Problem(index, field, f"logprob {values[pos]!r} at position {pos} is positive (must be <= 0)")
        )


def _check_token_ids(
    index: int, field: str, ids: list[int], vocab_size: int | None, out: list[Problem]
) -> None:
    if not ids:
        return
    low = min(ids)
    if low < 0:
        out.append(Problem(index, field, f"token id {low} at position {ids.index(low)} is negative"))
    if vocab_size is not None:
        high = max(ids)
        if high >= vocab_size:
            out.append(
                Problem(
                    index,
                    field,
                    f"token id {high} at position {ids.index(high)} is outside the vocabulary [0, {vocab_size})",
                )
            )


def _check_length(
    index: int, field: str, values: list[Any], expected: int, of: str, out: list[Problem]
) -> None:
    if len(values) != expected:
        out.append(Problem(index, field, f"has {len(values)} entries; {of} has {expected}"))


def _check_shape(index: int, sample: TrainingSample, *, seq_len: int, out: list[Problem]) -> None:
    """The rules about lengths (the ones the constrained decode cannot express)."""
    n_prompt = len(sample.prompt_ids)
    n_completion = len(sample.completion_ids)
    if n_prompt == 0:
        out.append(Problem(index, "prompt_ids", "must not be empty"))
    if n_completion == 0:
        out.append(Problem(index, "completion_ids", "must not be empty"))
    if n_prompt + n_completion > seq_len:
        out.append(
            Problem(
                index,
                "prompt_ids+completion_ids",
                f"prompt ({n_prompt}) + completion ({n_completion}) = {n_prompt + n_completion} tokens "
                f"exceeds the run's seq_len {seq_len}",
            )
        )
    _check_length(index, "prompt_mask", sample.prompt_mask, n_prompt, "prompt_ids", out)
    _check_length(index, "completion_mask", sample.completion_mask, n_completion, "completion_ids", out)
    _check_length(
        index, "completion_logprobs", sample.completion_logprobs, n_completion, "completion_ids", out
    )
    if sample.advantage is None:
        out.append(Problem(index, "advantage", "is required (a number, or one per completion token)"))
    elif isinstance(sample.advantage, list):
        _check_length(index, "advantage", sample.advantage, n_completion, "completion_ids", out)
    if sample.teacher_logprobs is not None:
        _check_length(index, "teacher_logprobs", sample.teacher_logprobs, n_completion, "completion_ids", out)


def _check_values(index: int, sample: TrainingSample, *, vocab_size: int | None, out: list[Problem]) -> None:
    """The rules about values (token ids, finite floats, logprobs <= 0)."""
    _check_token_ids(index, "prompt_ids", sample.prompt_ids, vocab_size, out)
    _check_token_ids(index, "completion_ids", sample.completion_ids, vocab_size, out)
    _check_logprobs(index, "completion_logprobs", sample.completion_logprobs, out)
    advantage = sample.advantage
    if isinstance(advantage, list):
        bad = _finite_floats(advantage)
        if bad is not None:
            out.append(
                Problem(index, "advantage", f"value {advantage[bad]!r} at position {bad} is not finite")
            )
    elif advantage is not None and not math.isfinite(advantage):
        out.append(Problem(index, "advantage", f"value {advantage!r} is not finite"))
    if sample.teacher_logprobs is not None:
        _check_logprobs(index, "teacher_logprobs", sample.teacher_logprobs, out)


def _check_batch_fields(batch: TrainingBatch, out: list[Problem]) -> None:
    if not (math.isfinite(batch.temperature) and batch.temperature > 0.0):
        out.append(Problem(None, "temperature", f"must be a finite number > 0, not {batch.temperature!r}"))
    if batch.step < 0:
        out.append(Problem(None, "step", f"must be >= 0, not {batch.step}"))
    for name in ("env", "agent"):
        label = getattr(batch, name)
        if label is not None and len(label) > MAX_LABEL_CHARS:
            out.append(Problem(None, name, f"is longer than {MAX_LABEL_CHARS} characters"))


def _count_problems(batch: TrainingBatch, out: list[Problem]) -> bool:
    n = len(batch.examples)
    if n == 0:
        out.append(Problem(None, "examples", "must hold at least one sample"))
    elif n > MAX_EXAMPLES_PER_BATCH:
        out.append(
            Problem(
                None, "examples", f"has {n} samples; at most {MAX_EXAMPLES_PER_BATCH} per batch (split it)"
            )
        )
        return False  # not worth checking the samples of a batch that is refused anyway
    return True


def batch_problems(batch: TrainingBatch, *, seq_len: int, vocab_size: int | None) -> list[Problem]:
    """Every rule broken by `batch` for a run with this seq_len and base-model vocabulary (None: unknown)."""
    out: list[Problem] = []
    if not _count_problems(batch, out):
        return out
    _check_batch_fields(batch, out)
    for index, sample in enumerate(batch.examples):
        _check_shape(index, sample, seq_len=seq_len, out=out)
        _check_values(index, sample, vocab_size=vocab_size, out=out)
    return out


# --------------------------------------------------------------------------- constrained decoding

_MAX_FLOAT = sys.float_info.max
# ge/le with the largest finite double: NaN and ±inf fail the comparison, so the decoder rejects them.
_Finite = Annotated[float, msgspec.Meta(ge=-_MAX_FLOAT, le=_MAX_FLOAT)]
_LogProb = Annotated[float, msgspec.Meta(ge=-_MAX_FLOAT, le=0.0)]
_Temperature = Annotated[float, msgspec.Meta(gt=0.0, le=_MAX_FLOAT)]
_Label = Annotated[str, msgspec.Meta(max_length=MAX_LABEL_CHARS)]


@lru_cache(maxsize=64)
def _constrained_decoders(vocab_size: int | None) -> tuple[msgspec.json.Decoder, msgspec.msgpack.Decoder]:
    """Decoders for subclasses of TrainingSample/TrainingBatch that only narrow field types.

    Subclasses keep the wire structs' fields, order, defaults and encoding, so what they decode
    is a TrainingBatch (isinstance holds) and encodes to the same bytes.
    """
    token = (
        Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]
        if vocab_size is not None
        else Annotated[int, msgspec.Meta(ge=0)]
    )
    sample = msgspec.defstruct(
        "TrainingSample",
        [
            ("prompt_ids", list[token]),
            ("completion_ids", list[token]),
            ("completion_logprobs", list[_LogProb]),
            ("advantage", _Finite | list[_Finite] | None, None),
            ("teacher_logprobs", list[_LogProb] | None, None),
        ],
        bases=(TrainingSample,),
        forbid_unknown_fields=True,
    )
    batch = msgspec.defstruct(
        "TrainingBatch",
        [
            (
                "examples",
                Annotated[list[sample], msgspec.Meta(min_length=1, max_length=MAX_EXAMPLES_PER_BATCH)],
            ),
            ("temperature", _Temperature, 1.0),
            ("step", Annotated[int, msgspec.Meta(ge=0)], 0),
            ("env", _Label | None, None),
            ("agent", _Label | None, None),
        ],
        bases=(TrainingBatch,),
        forbid_unknown_fields=True,
    )
    return msgspec.json.Decoder(batch), msgspec.msgpack.Decoder(batch)


def decode_and_validate(body: bytes, *, msgpack: bool, seq_len: int, vocab_size: int | None) -> TrainingBatch:
    """Decode a request body into a TrainingBatch that breaks no rule, or raise a 422 listing every problem."""
    if not body:
        raise reject([Problem(None, "body", "request body is empty; expected a TrainingBatch")])
    json_decoder, msgpack_decoder = _constrained_decoders(vocab_size)
    try:
        batch: TrainingBatch = msgpack_decoder.decode(body) if msgpack else json_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        # Slow path, bad input only: decode without constraints and check every rule in Python.
        problems = batch_problems(decode_batch(body, msgpack=msgpack), seq_len=seq_len, vocab_size=vocab_size)
        raise reject(problems or [_problem_from_msgspec(exc)]) from None
    problems: list[Problem] = []
    for index, sample in enumerate(batch.examples):
        _check_shape(index, sample, seq_len=seq_len, out=problems)
    if problems:
        raise reject(problems)
    return batch


def batch_num_tokens(batch: TrainingBatch) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.examples)
