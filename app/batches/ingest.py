"""From a request body to the bytes stored for a rollout batch (contracts/arrays.py).

A binary body (msgpack, per-token fields as `bytes`) is decoded once into an `ArrayBatch` — the
per-token arrays stay bytes, no Python object per token — checked with whole-batch numpy reductions,
and stored as received: its sha256 is the digest of the body itself. A list body (JSON, or msgpack
with lists) is decoded and checked by the constrained decoder of validation.py (the rules of
`contracts.wire.batch_problems`, in msgspec's C loop), converted once to the binary
form and stored as that form's canonical encoding (`contracts.arrays.encode`, the SDK's encoder), so
the same batch sent as JSON and as binary stores the same bytes under the same digest.
"""

import hashlib
from dataclasses import dataclass

from app.batches.validation import (
    DECODE_ERRORS,
    _problem_from_msgspec,
    decode_and_validate,
    decode_batch,
    reject,
)
from app.errors import ValidationFailed
from contracts.arrays import (
    MAX_TOKEN_ID,
    ArrayBatch,
    array_batch_decoder,
    array_batch_problems,
    encode,
    to_arrays,
)
from contracts.wire import Problem


@dataclass(frozen=True)
class Ingested:
    batch: ArrayBatch
    data: bytes
    """The bytes to store (the body itself for a binary body)."""
    sha256: str


def _decode_binary(body: bytes) -> tuple[ArrayBatch | None, Exception | None]:
    try:
        return array_batch_decoder.decode(body), None
    except DECODE_ERRORS as exc:
        return None, exc


def _from_lists(body: bytes, *, msgpack: bool, seq_len: int, vocab_size: int | None) -> Ingested:
    """A list body: checked as lists (so messages quote the values sent), then converted once."""
    limit = MAX_TOKEN_ID + 1 if vocab_size is None else vocab_size  # ids travel as int32
    try:
        # The constrained decoder checks values inside msgspec's C loop (validation.py).
        lists = decode_and_validate(body, msgpack=msgpack, seq_len=seq_len, vocab_size=limit)
    except ValidationFailed as list_error:
        # A binary body with a wrong field: the list decoder would only say "got bytes" at the first
        # array; the binary decoder names the real fault (and the list decoder is right for lists).
        _, exc = _decode_binary(body) if msgpack else (None, None)
        if exc is not None and "got `bytes`" in list_error.message:
            raise reject([_problem_from_msgspec(exc)]) from None
        raise
    batch = to_arrays(lists)
    # float64 values beyond float32's range become ±inf in the conversion: checked once more.
    problems = array_batch_problems(batch, seq_len=seq_len, vocab_size=vocab_size)
    if problems:
        raise reject(problems)
    data = encode(batch)
    return Ingested(batch, data, hashlib.sha256(data).hexdigest())


def ingest(body: bytes, *, msgpack: bool, seq_len: int, vocab_size: int | None) -> Ingested:
    """Decode and check a batch body; a 422 listing every problem, or what to store."""
    if not body:
        raise reject([Problem(None, "body", "request body is empty; expected a TrainingBatch")])
    if msgpack:
        batch, _ = _decode_binary(body)
        if batch is not None:
            problems = array_batch_problems(batch, seq_len=seq_len, vocab_size=vocab_size)
            if problems:
                raise reject(problems)
            return Ingested(batch, body, hashlib.sha256(body).hexdigest())
    return _from_lists(body, msgpack=msgpack, seq_len=seq_len, vocab_size=vocab_size)


def request_digest(body: bytes, *, msgpack: bool) -> str | None:
    """The digest a well-formed body would be stored under (for replays of a run that stopped);
    None for a body that does not decode."""
    if msgpack and _decode_binary(body)[0] is not None:
        return hashlib.sha256(body).hexdigest()
    try:
        batch = to_arrays(decode_batch(body, msgpack=msgpack))
    except (ValidationFailed, OverflowError, ValueError):
        return None
    return hashlib.sha256(encode(batch)).hexdigest()
