"""Tars built block by block, for the checks of contracts/tar_headers.py: the pax digit bomb
(CVE-2024-6232: Python < 3.11.10 took 19 s over 40,000 digits, holding the GIL), headers that would
move `tarfile` where a naive walk does not look, and legitimate archives at the bounds."""

import gzip
import io
import tarfile
from collections.abc import Callable
from typing import Any

from contracts.tar_headers import MAX_DIGIT_RUN, MAX_EXTENDED_HEADER_BYTES, MAX_PAX_RECORDS

BLOCK = tarfile.BLOCKSIZE
END = b"\0" * (2 * BLOCK)
CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % BLOCK)


def header(name: str, *, kind: bytes = tarfile.REGTYPE, size: int = 0) -> bytes:
    """One ustar header block (its size field says `size`; no data follows unless appended)."""
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def member(name: str, data: bytes = b"") -> bytes:
    return header(name, size=len(data)) + padded(data)


def extended(payload: bytes, kind: bytes = tarfile.XHDTYPE) -> bytes:
    """An extended header (pax `x`/`g`, GNU `L`/`K`) holding `payload`."""
    return header("././@PaxHeader", kind=kind, size=len(payload)) + padded(payload)


def pax_record(keyword: bytes, value: bytes) -> bytes:
    """`"<length> <keyword>=<value>\\n"`, the length counting its own digits."""
    rest = b" " + keyword + b"=" + value + b"\n"
    length = len(rest) + 1
    while len(str(length)) + len(rest) != length:
        length += 1
    return str(length).encode() + rest


def with_size_field(block: bytes, size: int) -> bytes:
    """A header block whose size field is `size` in base-256 (how a negative one is written), its
    checksum made good again."""
    raw = bytearray(block)
    raw[124:136] = bytes([0o377 if size < 0 else 0o200]) + (size % 256**11).to_bytes(11, "big")
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw)
    return bytes(raw)


def pax_digit_bomb(digits: int = 40_000) -> bytes:
    """The prober's archive: one pax header holding nothing but `digits` ASCII digits."""
    return extended(b"1" * digits) + END


def largest_accepted_pax(run: int = MAX_DIGIT_RUN) -> bytes:
    """A pax header of exactly MAX_EXTENDED_HEADER_BYTES, its value runs of `run` digits (by default
    the longest accepted: the most one header gives `tarfile`'s regexes; 0: no digits but the
    record's length, so that many fit in the archive's digit bound)."""
    pattern = b"1" * run + b"a"
    value = pattern * (MAX_EXTENDED_HEADER_BYTES // len(pattern) + 1)
    while len(record := pax_record(b"comment", value)) > MAX_EXTENDED_HEADER_BYTES:
        value = value[: -(len(record) - MAX_EXTENDED_HEADER_BYTES)]
    assert len(record) == MAX_EXTENDED_HEADER_BYTES
    return record


def refused_archives(config: bytes = b"{}") -> dict[str, tuple[bytes, str]]:
    """Archives refused before `tarfile` reads them, each with (a part of) the reason it is given."""
    config_member = member(CONFIG_NAME, config)
    over = MAX_EXTENDED_HEADER_BYTES + 1
    return {
        "the pax digit bomb": (pax_digit_bomb(), "pax extended header at byte 0 is 40000 bytes"),
        "a digit bomb within the size bound": (
            extended(b"1" * 8000) + END,
            "pax extended header at byte 0 holds a run of 8000 digits",
        ),
        "a well-formed record one digit past the run bound": (
            extended(pax_record(b"path", b"1" * (MAX_DIGIT_RUN + 1))) + config_member + END,
            f"holds a run of {MAX_DIGIT_RUN + 1} digits",
        ),
        "a pax header one byte over the bound": (
            extended(pax_record(b"comment", b"x" * (over - 14))) + config_member + END,
            f"is {over} bytes (at most {MAX_EXTENDED_HEADER_BYTES}",
        ),
        "a global pax header over the bound": (
            extended(b"x" * over, tarfile.XGLTYPE) + config_member + END,
            f"pax global header at byte 0 is {over} bytes",
        ),
        "a GNU long name over the bound": (
            extended(b"a" * over, tarfile.GNUTYPE_LONGNAME) + config_member + END,
            f"GNU long name header at byte 0 is {over} bytes",
        ),
        "a GNU long link over the bound": (
            extended(b"a" * over, tarfile.GNUTYPE_LONGLINK) + config_member + END,
            f"GNU long link name header at byte 0 is {over} bytes",
        ),
        "records a lenient parser reads quadratically": (
            extended(b"4 a " * 500 + b"=") + config_member + END,
            "malformed record at byte 0",
        ),
        "too many pax records": (
            extended(b"5 a=\n" * (MAX_PAX_RECORDS + 1)) + config_member + END,
            f"more than {MAX_PAX_RECORDS} records",
        ),
        "bytes after the pax records": (
            extended(pax_record(b"path", b"a") + b"\0" + pax_record(b"size", b"0")) + config_member + END,
            "bytes other than padding after its records",
        ),
        "a hdrcharset that is not UTF-8 (UnicodeDecodeError out of tarfile)": (
            extended(pax_record(b"hdrcharset", b"\xff\xfe")) + config_member + END,
            "hdrcharset record that is not UTF-8",
        ),
        "a global pax size": (
            extended(pax_record(b"size", b"10"), tarfile.XGLTYPE) + config_member + END,
            "sets a size for every member",
        ),
        "a negative pax size": (
            extended(pax_record(b"size", b"-512")) + config_member + END,
            "gives a negative size",
        ),
        "a negative size field (tarfile goes back and lists a member forever)": (
            config_member + with_size_field(header(WEIGHTS_NAME), -BLOCK) + END,
            f"member header at byte {len(config_member)} gives a negative size",
        ),
        "a size field past any archive (the scan's seek overflowed: a 500)": (
            config_member + with_size_field(header(WEIGHTS_NAME), 2**80) + END,
            f"gives a size of {2**80} bytes, more than any archive holds",
        ),
        "a pax size past any archive": (
            extended(pax_record(b"size", b"9" * 30)) + config_member + END,
            "more than any archive holds",
        ),
        "a GNU sparse member": (
            header(CONFIG_NAME, kind=tarfile.GNUTYPE_SPARSE) + END,
            "is a GNU sparse file",
        ),
        "GNU sparse records in a pax header": (
            extended(pax_record(b"GNU.sparse.major", b"1") + pax_record(b"GNU.sparse.minor", b"0"))
            + config_member
            + END,
            "describes a GNU sparse file",
        ),
        "five extended headers in a row": (
            extended(pax_record(b"path", b"a")) * 5 + config_member + END,
            "one of more than 4 extended headers in a row",
        ),
        # tarfile takes the pax size over the header's: a walk by the header's (1024) would skip
        # the bomb that tarfile reads right after the header (pax size 0).
        "a pax size that puts the next header on a bomb": (
            extended(pax_record(b"size", b"0")) + header(CONFIG_NAME, size=2 * BLOCK) + pax_digit_bomb(),
            "pax extended header at byte 1536 is 40000 bytes",
        ),
        # tarfile skips no data after a directory, whatever its size field says.
        "a directory whose size would skip a bomb": (
            header("sub/", kind=tarfile.DIRTYPE, size=2 * BLOCK) + pax_digit_bomb(),
            "pax extended header at byte 512 is 40000 bytes",
        ),
    }


def gzip_polyglot() -> bytes:
    """A gzip stream of junk whose header's extra field holds the pax digit bomb as a plain tar
    (8,000 digits: the field holds 64 KiB). `tarfile.open(mode="r:*")` fails on it as gzip, then
    parses the very bytes again as a plain tar."""
    bomb = bytearray(extended(b"1" * 8000) + END)
    gzip_start = b"\x1f\x8b\x08\x04" + b"\0" * 6  # deflate, FEXTRA; then XLEN, the field's length
    bomb[: len(gzip_start) + 2] = gzip_start + len(bomb[12:]).to_bytes(2, "little")
    bomb[148:156] = b" " * 8
    bomb[148:156] = b"%06o\0 " % sum(bomb[:BLOCK])  # the gzip bytes are part of the tar name
    body = io.BytesIO()
    with gzip.GzipFile(fileobj=body, mode="wb", mtime=0) as gz:
        gz.write(b"junk, not a tar" * 100)
    return bytes(bomb) + body.getvalue()[10:]  # its deflate data, CRC and size after the field


def refusing(calls: list[str], what: str) -> Callable[..., Any]:
    """A stand-in for a tarfile entry point that records its name in `calls`, then refuses as
    tarfile refuses a bad archive: a test sees whether tarfile was reached, never a hang."""

    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(what)
        raise tarfile.ReadError(f"{what} was called")

    return call
