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


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
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


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value): an int for varint/fixed fields, bytes for LEN fields."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
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


def _as_bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ProtoError("expected a length-delimited field")
    return value


def _as_int(value: int | bytes) -> int:
    if isinstance(value, bytes):
        raise ProtoError("expected a scalar field")
    return value


def _signed32(value: int) -> int:
    value &= 0xFFFFFFFFFFFFFFFF
    return value - (1 << 64) if value >= 1 << 63 else value


def _double(value: int | bytes) -> float:
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


@dataclass
class Tensor:
    data: np.ndarray
    """Flat values; `shape` gives the layout."""
    shape: list[int]


@dataclass
class Datum:
    tokens: list[int]
    """The model input: the tokens of its encoded-text chunks, in order."""
    loss_fn_inputs: dict[str, Tensor]


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    loss_fn: str = ""
    forward_only: bool = False
    data: list[Datum] = field(default_factory=list)
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)


def _tensor(buf: bytes) -> Tensor:
    dense, dtype, shape, sparse = b"", 0, [], False
    for number, wire, value in _fields(buf):
        if number == 1:
            dense = _as_bytes(value)
        elif number == 2:
            sparse = True
        elif number == 3:
            dtype = _as_int(value)
        elif number == 4:
            if wire == _LEN:  # packed repeated int64
                pos, raw = 0, _as_bytes(value)
                while pos < len(raw):
                    item, pos = _read_varint(raw, pos)
                    shape.append(_signed32(item))
            else:
                shape.append(_signed32(_as_int(value)))
    if sparse:
        raise ProtoError("sparse tensors are not supported by loraloom: send dense loss_fn_inputs")
    np_dtype = _NUMPY_OF_DTYPE.get(dtype)
    if np_dtype is None:
        raise ProtoError(f"unsupported tensor dtype {dtype}")
    if len(dense) % np.dtype(np_dtype).itemsize:
        raise ProtoError("tensor bytes are not a whole number of elements")
    return Tensor(data=np.frombuffer(dense, dtype=np_dtype).copy(), shape=shape)


def _chunk_tokens(buf: bytes) -> list[int]:
    for number, _, value in _fields(buf):
        if number == 1:  # encoded_text
            for inner, _, tokens in _fields(_as_bytes(value)):
                if inner == 1:
                    raw = _as_bytes(tokens)
                    if len(raw) % 4:
                        raise ProtoError("encoded_text tokens are not int32s")
                    return [int(t) for t in np.frombuffer(raw, dtype="<i4")]
            return []
        if number in (2, 3):
            raise ProtoError("image and audio inputs are not supported by loraloom: send token chunks")
    return []


def _map_entry(buf: bytes) -> tuple[str, int | bytes | None]:
    key, val = "", None
    for number, _, value in _fields(buf):
        if number == 1:
            key = _as_bytes(value).decode()
        elif number == 2:
            val = value
    return key, val


def _datum(buf: bytes) -> Datum:
    datum = Datum(tokens=[], loss_fn_inputs={})
    for number, _, value in _fields(buf):
        if number == 1:
            datum.tokens.extend(_chunk_tokens(_as_bytes(value)))
        elif number == 2:
            key, tensor = _map_entry(_as_bytes(value))
            datum.loss_fn_inputs[key] = _tensor(_as_bytes(tensor or b""))
    return datum


def _config_value(buf: bytes) -> float | str:
    for number, _, value in _fields(buf):
        if number == 1:
            return _double(value)
        if number == 2:
            return _as_bytes(value).decode()
    return 0.0


def decode_forward_backward_request(body: bytes) -> ForwardBackwardRequest:
    """Parse a `tinker_public.ForwardBackwardRequest` (raises ProtoError on a malformed body)."""
    req = ForwardBackwardRequest()
    legacy: dict[str, float | str] = {}
    try:
        for number, _, value in _fields(body):
            if number == 1:
                req.model_id = _as_bytes(value).decode()
            elif number == 2:
                req.seq_id = _signed32(_as_int(value))
            elif number == 3:
                req.data.append(_datum(_as_bytes(value)))
            elif number == 4:
                req.loss_fn = _as_bytes(value).decode()
            elif number == 5:
                key, raw = _map_entry(_as_bytes(value))
                legacy[key] = _double(raw if raw is not None else 0)
            elif number == 6:
                req.forward_only = bool(_as_int(value))
            elif number == 7:
                key, raw = _map_entry(_as_bytes(value))
                req.loss_fn_config[key] = _config_value(_as_bytes(raw or b""))
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
