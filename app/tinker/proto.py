"""A small proto3 codec for the few Tinker messages that travel as protobuf.

The SDK sends `forward_backward` bodies as `tinker_public.ForwardBackwardRequest` and accepts
`ForwardBackwardOutput` results as protobuf. We read and write those messages by hand (varints and
length-delimited fields, nothing else) rather than depend on protobuf and the SDK's generated
module in the service. Field numbers are those of `tinker_public.proto` in tinker 0.38.0; the
tests check this codec against bytes the SDK itself produces and parses.
"""

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

# tinker_public.DType
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY_OF_DTYPE = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}


class ProtoError(ValueError):
    """The body is not a message of the expected shape."""


# --- wire primitives --------------------------------------------------------------------


Buf = bytes | memoryview
"""A length-delimited field's value: a view into the request body (decoding copies nothing it can
leave in place: a datum's tokens and tensors are numpy views of the body)."""

MAX_FIELDS = 256 * 1024
"""Fields one request may hold, at every level together. Decoding costs Python work per field
(about a microsecond), so the count, not the body's size, bounds it: 32 MB of one-byte varints in a
tensor's shape cost 38 s of CPU before this bound (hostile probe, finding 5). The SDK writes a few
dozen per datum (its chunks, the loss inputs' map entries and tensors), so even 1,024 datums with
many chunks each stay far below it."""


class _Budget:
    """The fields a decode may still read (`MAX_FIELDS`)."""

    __slots__ = ("left",)

    def __init__(self, fields: int) -> None:
        self.left = fields

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ProtoError(f"more than {MAX_FIELDS} protobuf fields in one request")


def _read_varint(buf: Buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ProtoError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> 64:  # a tenth byte above bit 63: no 64-bit value
                raise ProtoError("varint beyond 64 bits")
            return result, pos
        shift += 7


def _fields(buf: Buf, budget: _Budget) -> Iterator[tuple[int, int, int | Buf]]:
    """(field number, wire type, value): an int for varint/fixed fields, a slice of `buf` for LEN
    fields (a view when `buf` is one). Each field read spends one of `budget`."""
    pos = 0
    while pos < len(buf):
        budget.spend()
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | Buf
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ProtoError("truncated length-delimited field")
            value, pos = buf[pos : pos + size], pos + size
        elif wire == _I64:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == _I32:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise ProtoError(f"unsupported wire type {wire}")
        if pos > len(buf):
            raise ProtoError("truncated fixed-width field")
        yield number, wire, value


def _as_bytes(value: int | Buf) -> Buf:
    if isinstance(value, int):
        raise ProtoError("expected a length-delimited field")
    return value


def _as_int(value: int | Buf) -> int:
    if not isinstance(value, int):
        raise ProtoError("expected a scalar field")
    return value


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _double(value: int | Buf) -> float:
    return float(struct.unpack("<d", _as_int(value).to_bytes(8, "little"))[0])


def _varint(value: int) -> bytes:
    value &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _len_field(number: int, payload: bytes) -> bytes:
    return _key(number, _LEN) + _varint(len(payload)) + payload


# --- ForwardBackwardRequest (decode) -----------------------------------------------------

MAX_SHAPE_DIMS = 8
"""Dimensions of a loss_fn_inputs tensor's shape (the SDK sends one: each input is per token)."""
MAX_STRING_BYTES = 1024
"""A model id, loss function name, map key or config text: short names, never data (a longer one
would be echoed in error messages or looked up in the database)."""


@dataclass
class Tensor:
    data: np.ndarray
    """Flat values (a read-only view of the request body); `shape` gives the layout."""
    shape: list[int]


@dataclass
class Datum:
    token_ids: np.ndarray
    """The model input: the int32 tokens of its encoded-text chunks, in order (a view of the body
    when it has one chunk): its length is known, and checked, before any of it becomes Python ints."""
    loss_fn_inputs: dict[str, Tensor]

    @property
    def tokens(self) -> list[int]:
        tokens: list[int] = self.token_ids.tolist()
        return tokens


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)


def _string(value: int | Buf, what: str) -> str:
    raw = _as_bytes(value)
    if len(raw) > MAX_STRING_BYTES:
        raise ProtoError(f"{what} is longer than {MAX_STRING_BYTES} bytes")
    return bytes(raw).decode()


def _shape(raw: Buf, shape: list[int]) -> None:
    """A packed repeated int64 `shape`, refused past MAX_SHAPE_DIMS before it is read."""
    if len(raw) > 10 * MAX_SHAPE_DIMS:  # 10 bytes: the longest varint
        raise ProtoError(f"a tensor shape has more than {MAX_SHAPE_DIMS} dimensions")
    pos = 0
    while pos < len(raw):
        item, pos = _read_varint(raw, pos)
        shape.append(_signed32(item))


def _tensor(buf: Buf, budget: _Budget) -> Tensor:
    dense: Buf = b""
    dtype, sparse = 0, False
    shape: list[int] = []
    for number, wire, value in _fields(buf, budget):
        if number == 1:
            dense = _as_bytes(value)
        elif number == 2:
            sparse = True
        elif number == 3:
            dtype = _as_int(value)
        elif number == 4:
            if wire == _LEN:  # packed repeated int64
                _shape(_as_bytes(value), shape)
            else:
                shape.append(_signed32(_as_int(value)))
        if len(shape) > MAX_SHAPE_DIMS:
            raise ProtoError(f"a tensor shape has more than {MAX_SHAPE_DIMS} dimensions")
    if sparse:
        raise ProtoError("sparse tensors are not supported by loraloom: send dense loss_fn_inputs")
    np_dtype = _NUMPY_OF_DTYPE.get(dtype)
    if np_dtype is None:
        raise ProtoError(f"unsupported tensor dtype {dtype}")
    if len(dense) % np.dtype(np_dtype).itemsize:
        raise ProtoError("tensor bytes are not a whole number of elements")
    return Tensor(data=np.frombuffer(dense, dtype=np_dtype), shape=shape)


_NO_TOKENS = np.zeros(0, dtype="<i4")


def _chunk_tokens(buf: Buf, budget: _Budget) -> np.ndarray:
    for number, _, value in _fields(buf, budget):
        if number == 1:  # encoded_text
            for inner, _, tokens in _fields(_as_bytes(value), budget):
                if inner == 1:
                    raw = _as_bytes(tokens)
                    if len(raw) % 4:
                        raise ProtoError("encoded_text tokens are not int32s")
                    return np.frombuffer(raw, dtype="<i4")
            return _NO_TOKENS
        if number in (2, 3):
            raise ProtoError("image and audio inputs are not supported by loraloom: send token chunks")
    return _NO_TOKENS


def _map_entry(buf: Buf, budget: _Budget) -> tuple[str, int | Buf | None]:
    key, val = "", None
    for number, _, value in _fields(buf, budget):
        if number == 1:
            key = _string(value, "a map key")
        elif number == 2:
            val = value
    return key, val


def _datum(buf: Buf, budget: _Budget) -> Datum:
    chunks: list[np.ndarray] = []
    inputs: dict[str, Tensor] = {}
    for number, _, value in _fields(buf, budget):
        if number == 1:
            chunks.append(_chunk_tokens(_as_bytes(value), budget))
        elif number == 2:
            key, tensor = _map_entry(_as_bytes(value), budget)
            inputs[key] = _tensor(_as_bytes(tensor or b""), budget)
    tokens = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else _NO_TOKENS
    return Datum(token_ids=tokens, loss_fn_inputs=inputs)


def _config_value(buf: Buf, budget: _Budget) -> float | str:
    for number, _, value in _fields(buf, budget):
        if number == 1:
            return _double(value)
        if number == 2:
            return _string(value, "a loss_fn_config text")
    return 0.0


def forward_backward_target(body: bytes) -> tuple[str, int]:
    """(model_id, seq_id) of a `ForwardBackwardRequest`, read from its top level only (the data is
    skipped, not decoded): the service finds the model, and an earlier request with that seq_id,
    before it decodes anything of the data. Raises ProtoError as the full decode would."""
    model_id, seq_id = "", 0
    budget = _Budget(MAX_FIELDS)
    try:
        for number, _, value in _fields(memoryview(body), budget):
            if number == 1:
                model_id = _string(value, "model_id")
            elif number == 2:
                seq_id = _signed32(_as_int(value))
    except UnicodeDecodeError as exc:
        raise ProtoError("a string field is not UTF-8") from exc
    return model_id, seq_id


def decode_forward_backward_request(body: bytes) -> ForwardBackwardRequest:
    """Parse a `tinker_public.ForwardBackwardRequest` (raises ProtoError on a malformed body, or one
    of more than MAX_FIELDS fields). Its datums' tokens and tensors stay numpy views of `body`: the
    caller bounds their lengths before it converts any of them."""
    req = ForwardBackwardRequest()
    legacy: dict[str, float | str] = {}
    budget = _Budget(MAX_FIELDS)
    try:
        for number, _, value in _fields(memoryview(body), budget):
            if number == 1:
                req.model_id = _string(value, "model_id")
            elif number == 2:
                req.seq_id = _signed32(_as_int(value))
            elif number == 3:
                req.data.append(_datum(_as_bytes(value), budget))
            elif number == 4:
                req.loss_fn = _string(value, "loss_fn")
            elif number == 5:
                key, raw = _map_entry(_as_bytes(value), budget)
                legacy[key] = _double(raw if raw is not None else 0)
            elif number == 6:
                req.forward_only = bool(_as_int(value))
            elif number == 7:
                key, raw = _map_entry(_as_bytes(value), budget)
                req.loss_fn_config[key] = _config_value(_as_bytes(raw or b""), budget)
    except UnicodeDecodeError as exc:
        raise ProtoError("a string field is not UTF-8") from exc
    # v2 carries strings too; the legacy map only numbers. Prefer v2, as the SDK's server does.
    req.loss_fn_config = {**legacy, **req.loss_fn_config}
    return req


# --- ForwardBackwardOutput (encode) -------------------------------------------------------


def _batched_tensor(per_datum: list[np.ndarray], dtype: int) -> bytes:
    np_dtype = _NUMPY_OF_DTYPE[dtype]
    arrays = [np.ascontiguousarray(a, dtype=np_dtype).ravel() for a in per_datum]
    offsets = np.zeros(len(arrays) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    data = b"".join(a.tobytes() for a in arrays)
    # trailing_shape (field 4) stays empty: each datum's output is one-dimensional.
    return _len_field(1, data) + _len_field(2, offsets.tobytes()) + _key(3, _VARINT) + _varint(dtype)


def encode_forward_backward_output(
    *, outputs: dict[str, list[np.ndarray]], num_datums: int, metrics: dict[str, float]
) -> bytes:
    """A `ForwardBackwardOutput` with one ArrayRecord: per field, one float32 array per datum."""
    record = _len_field(1, b"ArrayRecord")
    for name, per_datum in outputs.items():
        entry = _len_field(1, name.encode()) + _len_field(2, _batched_tensor(per_datum, DTYPE_FLOAT32))
        record += _len_field(2, entry)
    record += _key(3, _VARINT) + _varint(num_datums)
    out = _len_field(1, b"ArrayRecord") + _len_field(2, record)
    for name, value in metrics.items():
        entry = _len_field(1, name.encode()) + _key(2, _I64) + struct.pack("<d", float(value))
        out += _len_field(3, entry)
    return out


# --- SampleResponse (encode) -----------------------------------------------------------------

STOP_REASONS = {"stop": 0, "length": 1}


def encode_sample_response(
    sequences: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float | None] | None = None
) -> bytes:
    """A `SampleResponse`: per sequence its tokens (int32), logprobs (float32) and stop reason; the
    prompt's logprobs when asked for (float32, NaN where none: the SDK reads NaN as None)."""
    out = b""
    for tokens, logprobs, stop_reason in sequences:
        seq = _key(1, _VARINT) + _varint(STOP_REASONS[stop_reason])
        seq += _len_field(2, np.asarray(tokens, dtype="<i4").tobytes())
        seq += _len_field(3, np.asarray(logprobs, dtype="<f4").tobytes())
        out += _len_field(1, seq)
    if prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in prompt_logprobs]
        out += _len_field(2, np.asarray(values, dtype="<f4").tobytes())
    return out
