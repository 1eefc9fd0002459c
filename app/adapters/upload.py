"""An uploaded adapter, checked before anything of it is kept.

Nothing of an upload is trusted: the tar's headers are walked before tarfile parses them
(contracts/tar_headers.py: a pax header of digits held the GIL for seconds on Python < 3.11.10),
its members are read one by one (never `extractall`), only the two PEFT files are accepted, each
within its size limit, the config must be a JSON object and the weights a well-formed safetensors
file whose header matches its data.
"""

import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import IO, Any, TypeGuard

import numpy as np

from app.errors import PayloadTooLarge, UnsupportedMediaType, ValidationFailed
from app.http_semantics import SHOWN_MEDIA_TYPE_CHARS, media_type
from app.request_guard import MAX_JSON_DEPTH, too_deep
from contracts.durable import fsync_path
from contracts.layout import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS
from contracts.peft import (
    MAX_ADAPTER_TENSORS,
    MAX_TENSOR_DIMS,
    shown,
    shown_shape,
    too_many_tensors,
    whole_number,
)
from contracts.tar_headers import MAX_EXTENDED_HEADER_BYTES, TarHeaderProblem, check_tar_headers

MAX_CONFIG_BYTES = 1024 * 1024
MAX_HEADER_BYTES_PER_TENSOR = 512
"""A tensor's entry in a safetensors header, on average: a PEFT factor's takes ~130 bytes
(`"base_model.model.model.layers.31.self_attn.q_proj.lora_A.weight":{"dtype":"BF16","shape":[16,4096],
"data_offsets":[...]}`)."""
MAX_SAFETENSORS_HEADER_BYTES = MAX_ADAPTER_TENSORS * MAX_HEADER_BYTES_PER_TENSOR
"""8 MiB: an adapter of MAX_ADAPTER_TENSORS tensors fits with room to spare. The header is parsed whole
(the safetensors library's own limit is 100 MB, which parsed as 1,000,000 tensors: seconds of CPU and
2 GB of memory before anything was refused)."""

MAX_METADATA_ENTRIES = 1024
"""Entries of a safetensors header's `__metadata__` (PEFT writes one: `format`)."""
MAX_HEADER_TOKENS = 24 * MAX_ADAPTER_TENSORS + 8 * MAX_METADATA_ENTRIES
"""Quotes and commas a safetensors header may hold, counted before it is parsed (at C speed): a
tensor's entry has 10 quotes and at most 12 commas (a shape of MAX_TENSOR_DIMS), a metadata entry 4
quotes and a comma. It bounds the parser's work, which the size alone does not: 8 MiB of 700,000
one-character metadata entries took 3.1 s, holding the GIL (every tenant's requests waited), and
8 MiB of a shape's `1,` would be 4 million integers."""

_COPY_CHUNK = 1024 * 1024

MAX_TAR_MEMBERS = 8
"""Members of an uploaded tar walked before tarfile reads it (contracts/tar_headers.py). An adapter
has two; a few more get the exact refusal below (an unexpected member, one given twice)."""
MAX_TAR_EXTENDED_BYTES = 4 * MAX_EXTENDED_HEADER_BYTES
"""Extended (pax, GNU long name) header data of an uploaded tar: a pax header for each of its two
files, at the largest, and a global one."""

MAX_JSON_INT_DIGITS = 1000
"""The longest integer an adapter's JSON (its config, the safetensors header) may hold: far above any
value either needs (offsets are u64: 20 digits), and below Python's own limit (4300 digits), whose
error speaks of its internals (`sys.set_int_max_str_digits()`) rather than of the upload."""

# Bytes per element of every safetensors dtype, to check that each tensor's byte range
# matches its shape (a header that lies about sizes is a corrupt file).
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


TAR_MEDIA_TYPE = "application/x-tar"
"""The one Content-Type of an adapter upload: what the SDK (orchestrator/client.py), the pool
(trainer_core/service_client.py), clients generated from the OpenAPI document and the README's curl
send."""
_COMPRESSED = frozenset({"application/gzip", "application/x-gzip", "application/x-compressed-tar"})


def require_tar(content_type: str | None) -> None:
    """The 415 of an upload sent as anything but an uncompressed tar (application/x-tar, parameters
    aside), or without a Content-Type, naming the type it takes. A body of any type was read as a tar:
    a JSON or form body, or none declared, got a 201 or a 422 about a tar the client never meant to
    send. (A dependency of the route: before the body is looked at, once the request guard has read it
    within the body budget.)"""
    media = media_type(content_type)
    if media == TAR_MEDIA_TYPE:
        return
    shown_type = media[:SHOWN_MEDIA_TYPE_CHARS]  # a header can be 8 KB long
    said = f"unsupported Content-Type {shown_type!r}" if shown_type else "a body without a Content-Type"
    how = "the tar uncompressed, as " if media in _COMPRESSED else ""
    raise UnsupportedMediaType(
        f"{said}; send {how}{TAR_MEDIA_TYPE}",
        details={"content_type": shown_type or None, "accepted": [TAR_MEDIA_TYPE]},
    )


def _invalid(message: str, *, field: str = "body", kind: str = "invalid_tar") -> ValidationFailed:
    """A 422 `invalid_adapter` with one `{loc, msg, type}` item (README "Errors"): `loc` is the body,
    or the file of the archive at fault (as app/adapters/uploads.py names it), `type` the kind of
    problem."""
    loc = ["body"] if field == "body" else ["body", field]
    return ValidationFailed(
        message, code="invalid_adapter", details=[{"loc": loc, "msg": message, "type": kind}]
    )


def _copy_member(src: IO[bytes], dest: Path, *, limit: int, name: str) -> tuple[int, str]:
    """Copy one tar member to `dest`, fsynced; returns (bytes, sha256)."""
    digest = hashlib.sha256()
    size = 0
    with open(dest, "wb") as out:
        while chunk := src.read(_COPY_CHUNK):
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"{name} exceeds {limit} bytes")
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())
    return size, digest.hexdigest()


class IntegerTooLong(ValueError):
    """Well-formed JSON holding an integer of more than MAX_JSON_INT_DIGITS digits."""


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        raise IntegerTooLong(
            f"it holds an integer of {digits} digits (at most {MAX_JSON_INT_DIGITS} are accepted)"
        )
    return int(text)


def _parse_json(raw: bytes) -> Any:
    """`raw` parsed, or a ValueError saying why not. The depth is checked before the (recursive) parser
    sees it: `[` nested 100000 deep would raise RecursionError there. Malformed JSON, bytes that are not
    UTF-8 and an integer of more than MAX_JSON_INT_DIGITS digits (IntegerTooLong) are all ValueErrors."""
    if too_deep(raw):
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return json.loads(raw, parse_int=_bounded_int)


def _check_adapter_config(path: Path) -> None:
    try:
        config = _parse_json(path.read_bytes())
    except IntegerTooLong as exc:  # valid JSON: say what is wrong with it
        raise _invalid(f"{ADAPTER_CONFIG}: {exc}", field=ADAPTER_CONFIG, kind="integer_too_long") from exc
    except ValueError as exc:
        raise _invalid(
            f"{ADAPTER_CONFIG} is not valid JSON: {exc}", field=ADAPTER_CONFIG, kind="invalid_json"
        ) from exc
    if not isinstance(config, dict):
        raise _invalid(
            f"{ADAPTER_CONFIG} must be a JSON object", field=ADAPTER_CONFIG, kind="adapter_config_not_object"
        )


def _bad_safetensors(problem: str) -> ValidationFailed:
    return _invalid(
        f"{ADAPTER_WEIGHTS} is not a valid safetensors file: {problem}",
        field=ADAPTER_WEIGHTS,
        kind="invalid_safetensors",
    )


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file (8-byte little-endian length, then that much JSON) and the
    length of the data after it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _bad_safetensors("shorter than its 8-byte header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > MAX_SAFETENSORS_HEADER_BYTES:
            raise _bad_safetensors(
                f"its header is {header_len} bytes (at most {MAX_SAFETENSORS_HEADER_BYTES}: "
                f"{MAX_HEADER_BYTES_PER_TENSOR} per tensor of at most {MAX_ADAPTER_TENSORS})"
            )
        if header_len > size - 8:
            raise _bad_safetensors(f"header length {header_len} is larger than the file")
        raw = f.read(header_len)
    tokens = raw.count(b'"') + raw.count(b",")
    if tokens > MAX_HEADER_TOKENS:
        raise _bad_safetensors(
            f"its header holds {tokens} quotes and commas (at most {MAX_HEADER_TOKENS}: an adapter of at "
            f"most {MAX_ADAPTER_TENSORS} tensors and {MAX_METADATA_ENTRIES} metadata entries)"
        )
    try:
        header = _parse_json(raw)
    except IntegerTooLong as exc:
        raise _bad_safetensors(f"its header: {exc}") from exc
    except ValueError as exc:
        raise _bad_safetensors(f"header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _bad_safetensors("header is not a JSON object")
    return header, size - 8 - header_len


def _valid_offsets(offsets: object, data_len: int) -> TypeGuard[list[int]]:
    return (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(whole_number(o) for o in offsets)
        and 0 <= offsets[0] <= offsets[1] <= data_len
    )


def _shape_problem(shape: object, *, itemsize: int, data_len: int) -> str | None:
    """What is wrong with a tensor's shape, looked at before any arithmetic on it: a list of at most
    MAX_TENSOR_DIMS whole numbers >= 0, none larger than the data could hold (`data_len` bytes of
    `itemsize`-byte elements; a 0 elsewhere in the shape would make it hold none: no adapter's tensor
    is empty)."""
    if not isinstance(shape, list):
        return "a malformed shape (not a list of dimensions)"
    if len(shape) > MAX_TENSOR_DIMS:
        return f"{len(shape)} dimensions (at most {MAX_TENSOR_DIMS})"
    if not all(whole_number(d) and d >= 0 for d in shape):
        return f"a malformed shape {shown_shape(shape)} (dimensions are whole numbers >= 0)"
    if any(d > data_len // itemsize for d in shape):
        return (
            f"shape {shown_shape(shape)}, more {itemsize}-byte elements than the file's {data_len} "
            "bytes of data"
        )
    return None


def _nbytes_at_most(shape: list[int], *, itemsize: int, limit: int) -> int | None:
    """The bytes of a tensor of `shape`, or None once the product passes `limit` (it stops there:
    never more than one dimension's factor past the limit)."""
    if 0 in shape:
        return 0
    total = itemsize
    for d in shape:
        total *= d
        if total > limit:
            return None
    return total


def _check_tensor(name: str, info: object, data_len: int) -> None:
    """One tensor's entry: a known dtype, a shape, and a byte range inside the data that matches them."""
    if not isinstance(info, dict):
        raise _bad_safetensors(f"tensor {shown(name)} has no description")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise _bad_safetensors(f"tensor {shown(name)} has unknown dtype {shown(dtype)}")
    itemsize = _DTYPE_BYTES[dtype]
    if (problem := _shape_problem(shape, itemsize=itemsize, data_len=data_len)) is not None:
        raise _bad_safetensors(f"tensor {shown(name)} has {problem}")
    assert isinstance(shape, list)  # checked by _shape_problem
    if not _valid_offsets(offsets, data_len):
        raise _bad_safetensors(f"tensor {shown(name)} has data_offsets outside the file")
    span = offsets[1] - offsets[0]
    if _nbytes_at_most(shape, itemsize=itemsize, limit=span) != span:
        raise _bad_safetensors(
            f"tensor {shown(name)}: data_offsets do not match shape {shown_shape(shape)} and dtype {dtype}"
        )


def check_safetensors(path: Path) -> int:
    """Parse and check a safetensors header: at most MAX_ADAPTER_TENSORS tensors (counted before any
    is looked at), every one with a known dtype, a shape, and a byte range inside the file that
    matches them. Returns the number of tensors."""
    header, data_len = _read_safetensors_header(path)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad_safetensors("__metadata__ must map strings to strings")
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise _bad_safetensors(f"__metadata__ has {len(metadata)} entries (at most {MAX_METADATA_ENTRIES})")
    if len(header) > MAX_ADAPTER_TENSORS:
        raise _bad_safetensors(too_many_tensors(len(header), MAX_ADAPTER_TENSORS))
    for name, info in header.items():
        _check_tensor(name, info, data_len)
    if not header:
        raise _bad_safetensors("it holds no tensors")
    return len(header)


_NONFINITE_BITS = {
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F32": ("<u4", 0x7F80_0000),
    "F64": ("<u8", 0x7FF0_0000_0000_0000),
    "F8_E5M2": ("u1", 0x7C),
    "F8_E4M3": ("u1", 0x7F),  # the fn variant: no infinities; NaN is S.1111.111
}
"""Per float dtype, its bits as an unsigned integer and the mask whose bits are all set exactly in
NaN and ±inf (an exponent of all ones). Read as bits because numpy has no bfloat16 or float8, and
the control plane never imports torch. Its keys are the dtypes a LoRA factor may have
(contracts/peft.py FLOAT_DTYPES): every one the pool loads is scanned."""

_SCAN_CHUNK = 8 * 1024 * 1024
"""Bytes of a tensor read at a time: a multiple of every dtype's size, and memory bounded."""


def _has_nonfinite(f: IO[bytes], *, start: int, length: int, dtype: str) -> bool:
    bits, mask = _NONFINITE_BITS[dtype]
    f.seek(start)
    while length > 0:
        chunk = f.read(min(length, _SCAN_CHUNK))
        if not chunk:  # pragma: no cover - the header's offsets were checked against the file
            return False
        if np.any((np.frombuffer(chunk, dtype=bits) & mask) == mask):
            return True
        length -= len(chunk)
    return False


def nonfinite_tensors(path: Path) -> list[str]:
    """The float tensors of a checked safetensors file (`check_safetensors`) that hold NaN or ±inf:
    a pool would train from them and every step's loss be NaN."""
    header, data_len = _read_safetensors_header(path)
    data_start = path.stat().st_size - data_len
    found: list[str] = []
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__" or info["dtype"] not in _NONFINITE_BITS:
                continue
            first, last = info["data_offsets"]
            if _has_nonfinite(f, start=data_start + first, length=last - first, dtype=info["dtype"]):
                found.append(name)
    return found


def _check_headers(body: IO[bytes]) -> None:
    """Refuse, before tarfile parses it, a tar whose headers would cost tarfile more than linear
    time (an old Python's pax regex held the GIL for seconds: every request of the process waited)."""
    start = body.tell()
    try:
        check_tar_headers(body, max_members=MAX_TAR_MEMBERS, max_extended_bytes=MAX_TAR_EXTENDED_BYTES)
    except TarHeaderProblem as exc:
        raise _invalid(f"the tar is refused before it is read: {exc}") from exc
    body.seek(start)


def extract_adapter_tar(body: IO[bytes], staging: Path, *, max_bytes: int) -> tuple[int, str]:
    """Validate the uploaded tar and write its two files into `staging`.
    Returns (total bytes, sha256 of the safetensors file)."""
    sizes: dict[str, int] = {}
    weights_sha = ""
    _check_headers(body)
    try:
        with tarfile.open(fileobj=body, mode="r:") as tar:
            for member in tar:
                # Tools that tar a directory's contents write "./name"; nothing else is accepted.
                name = member.name.removeprefix("./")
                if name not in ADAPTER_FILES:
                    raise _invalid(
                        f"unexpected archive member {shown(member.name)}: the tar must hold exactly "
                        f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}"
                    )
                if not member.isreg() or member.issparse():
                    raise _invalid(f"archive member {shown(member.name)} is not a regular file")
                if name in sizes:
                    raise _invalid(f"archive member {name!r} appears twice")
                limit = MAX_CONFIG_BYTES if name == ADAPTER_CONFIG else max_bytes
                if member.size > limit:
                    raise PayloadTooLarge(f"{name} is {member.size} bytes; the limit is {limit}")
                src = tar.extractfile(member)
                assert src is not None  # a regular file always has data
                sizes[name], digest = _copy_member(src, staging / name, limit=limit, name=name)
                if name == ADAPTER_WEIGHTS:
                    weights_sha = digest
    except (tarfile.TarError, EOFError) as exc:
        raise _invalid(f"the body is not a valid uncompressed tar archive: {exc}") from exc
    except RecursionError as exc:
        # tarfile reads a GNU longname or pax header by recursing into the member after it: a chain
        # of thousands of them in a row (no tool writes more than one per member) recurses too deep.
        raise _invalid("the tar chains too many extended (GNU longname or pax) headers") from exc
    missing = [n for n in ADAPTER_FILES if n not in sizes]
    if missing:
        raise _invalid(f"the tar lacks {', '.join(missing)}", kind="missing_adapter_file")
    _check_adapter_config(staging / ADAPTER_CONFIG)
    check_safetensors(staging / ADAPTER_WEIGHTS)
    fsync_path(staging)
    return sum(sizes.values()), weights_sha
