"""Decoding and validation of rollout batches (JSON or msgpack) before anything is stored.

Every rule is checked for every sample, and every problem is reported as
`{"loc", "msg", "type"}` (the items of every 422 of the service) with `{"sample": index | None,
"field": name, "problem": text}` besides (contracts.wire.Problem.as_dict), so a client can fix a
whole batch from one 422.

Fast path: the body is decoded into subclasses of the wire structs whose number
fields carry msgspec constraints (token ids in [0, vocab_size), logprobs finite and
<= 0, advantages finite, temperature > 0, …), so the per-token checks run inside
msgspec's C decoder; only the per-sample shape rules (lengths, seq_len) are left to
Python. Ingestion throughput depends on it. When that decode fails, the body is
decoded again without constraints and every rule is checked in Python, so the 422
lists all the problems with readable messages.
"""

import re
import sys
from collections.abc import Sequence
from functools import lru_cache
from types import GenericAlias
from typing import Annotated, Any, TypeAlias

import msgspec

from app.errors import ValidationFailed
from contracts.pool_api import INT32_MAX
from contracts.wire import (
    MAX_ABS_SCALAR,
    MAX_EXAMPLES_PER_BATCH,
    MAX_LABEL_CHARS,
    MAX_SAMPLE_METRICS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    Problem,
    TrainingBatch,
    TrainingSample,
    batch_json_decoder,
    batch_msgpack_decoder,
    batch_problems,
    sample_shape_problems,
)

MAX_REPORTED_PROBLEMS = 100
"""A 422 lists at most this many problems (a batch of 4096 broken samples is one message, not a megabyte)."""

_AT_RE = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_SAMPLE_RE = re.compile(r"^\.examples\[(?P<index>\d+)\](?:\.(?P<field>\w+))?")
_FIELD_RE = re.compile(r"^\.(?P<field>\w+)")
_NAMED_FIELD_RE = re.compile(r"(?:unknown|required) field `(?P<field>[^`]+)`")


def reject(problems: Sequence[Problem]) -> ValidationFailed:
    """The 422 for a batch with problems (the first MAX_REPORTED_PROBLEMS of them)."""
    first = problems[0]
    where = f"sample {first.sample}, " if first.sample is not None else ""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return ValidationFailed(
        f"invalid batch: {where}{first.field}: {first.problem}{more}",
        details=[p.as_dict() for p in problems[:MAX_REPORTED_PROBLEMS]],
    )


DECODE_ERRORS = (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError)
"""What decoding a body may raise on bad input: msgspec's own errors, and (msgpack) a string that is
not UTF-8, which msgspec raises as Python's UnicodeDecodeError."""


def _problem_from_msgspec(exc: Exception) -> Problem:
    """Turn msgspec's `... - at `$.examples[3].prompt_ids[2]`` into (sample 3, field prompt_ids)."""
    if isinstance(exc, UnicodeDecodeError):  # no path: msgspec raises it from inside the string
        return Problem(None, "body", f"a string is not valid UTF-8 ({exc.reason})")
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
    except DECODE_ERRORS as exc:
        raise reject([_problem_from_msgspec(exc)]) from None


# --------------------------------------------------------------------------- constrained decoding

_MAX_FLOAT = sys.float_info.max
# ge/le with the largest finite double: NaN and ±inf fail the comparison, so the decoder rejects them.
_Finite = Annotated[float, msgspec.Meta(ge=-_MAX_FLOAT, le=_MAX_FLOAT)]
_LogProb = Annotated[float, msgspec.Meta(ge=-_MAX_FLOAT, le=0.0)]
_Temperature = Annotated[float, msgspec.Meta(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)]
_NO_NUL = "^[^\x00]*$"  # Postgres text cannot hold a NUL (JSON bodies are also checked before the route)
_Label = Annotated[str, msgspec.Meta(max_length=MAX_LABEL_CHARS, pattern=_NO_NUL)]
_Weight = Annotated[float, msgspec.Meta(ge=0.0, le=_MAX_FLOAT)]
_Scalar = Annotated[float, msgspec.Meta(ge=-MAX_ABS_SCALAR, le=MAX_ABS_SCALAR)]  # rewards, metric values
_MetricName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_LABEL_CHARS, pattern=_NO_NUL)]
_SampleMetrics = Annotated[dict[_MetricName, _Scalar], msgspec.Meta(max_length=MAX_SAMPLE_METRICS)]


@lru_cache(maxsize=64)
def _constrained_decoders(
    vocab_size: int | None,
) -> tuple[msgspec.json.Decoder[TrainingBatch], msgspec.msgpack.Decoder[TrainingBatch]]:
    """Decoders for subclasses of TrainingSample/TrainingBatch that only narrow field types.

    Subclasses keep the wire structs' fields, order, defaults and encoding, so what they decode
    is a TrainingBatch (isinstance holds) and encodes to the same bytes.
    """
    # Without a vocabulary (no pool registered yet) a token id is still bounded: no vocabulary
    # has 2**31 entries, and a larger integer would not survive the msgpack re-encode.
    Token: TypeAlias = Annotated[
        int, msgspec.Meta(ge=0, lt=vocab_size) if vocab_size is not None else msgspec.Meta(ge=0, le=INT32_MAX)
    ]
    sample = msgspec.defstruct(
        "TrainingSample",
        [
            ("prompt_ids", list[Token]),
            ("completion_ids", list[Token]),
            ("completion_logprobs", list[_LogProb]),
            ("advantage", _Finite | list[_Finite] | None, None),
            ("teacher_logprobs", list[_LogProb] | None, None),
            ("reward", _Scalar | None, None),
            ("token_rewards", list[_Finite] | None, None),
            ("weights", list[_Weight] | None, None),
            ("metrics", _SampleMetrics | None, None),
        ],
        bases=(TrainingSample,),
        forbid_unknown_fields=True,
    )
    # GenericAlias spells list[sample]: a class made at run time is not a type to a static checker.
    examples: object = Annotated[
        GenericAlias(list, (sample,)), msgspec.Meta(min_length=1, max_length=MAX_EXAMPLES_PER_BATCH)
    ]
    batch = msgspec.defstruct(
        "TrainingBatch",
        [
            ("examples", examples),
            ("temperature", _Temperature, 1.0),
            ("step", Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)], 0),  # a 32-bit column
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
    except DECODE_ERRORS as exc:
        # Slow path, bad input only: decode without constraints and check every rule in Python.
        problems = batch_problems(decode_batch(body, msgpack=msgpack), seq_len=seq_len, vocab_size=vocab_size)
        raise reject(problems or [_problem_from_msgspec(exc)]) from None
    # The constrained decode enforced the value rules; the length rules are left.
    problems = [
        Problem(index, field, problem)
        for index, sample in enumerate(batch.examples)
        for field, problem in sample_shape_problems(sample, seq_len=seq_len)
    ]
    if problems:
        raise reject(problems)
    return batch


def batch_num_tokens(batch: TrainingBatch) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.examples)


def documented_batch_schema() -> dict[str, Any]:
    """The JSON schema of what `decode_and_validate` accepts, for the OpenAPI document: the schema
    of the constrained decoder itself (vocabulary unknown), plus the shape rules a JSON schema can
    state. The rest (per-token lists as long as their ids, seq_len, the run's vocabulary) is in the
    descriptions. `$ref`s point at `#/$defs/...`."""
    json_decoder, _ = _constrained_decoders(None)
    schema = msgspec.json.schema(json_decoder.type)
    sample = schema["$defs"]["TrainingSample"]
    props = sample["properties"]
    for name in ("prompt_ids", "completion_ids"):
        props[name]["minItems"] = 1
    # The service requires an advantage (the struct's default None is for other callers).
    props["advantage"]["anyOf"] = [s for s in props["advantage"]["anyOf"] if s.get("type") != "null"]
    props["advantage"].pop("default", None)
    sample["required"] = [*sample["required"], "advantage"]
    sample["description"] = (
        f"{sample.get('description', '')} Every per-token list (prompt_mask; completion_mask, "
        "completion_logprobs, a list advantage, teacher_logprobs, token_rewards, weights) has as many "
        "entries as its ids; prompt + completion fit the run's seq_len; token ids are below the base "
        "model's vocabulary size."
    ).strip()
    return schema
