"""A linear-time check of a tar's header blocks, run before `tarfile` parses the archive.

Python's `tarfile` parses a pax extended header with regular expressions, and before 3.11.10
(CVE-2024-6232) `re.search(rb"\\d+ hdrcharset=([^\\n]+)\\n", buf)` takes time quadratic in a run of
digits: a 42 KB tar holding 40,000 of them kept a thread for 19 s, holding the GIL all along (every
other request of the process waited). The search runs over the header's blocks whole, so a run inside
a record's value costs as much as one anywhere else: (run length)² for each run, 2-3 ns per unit
(3.11.7; a value of 4,000 digits: 48 ms, of 8,000: 0.2 s). 3.11.10, 3.12.6 and 3.13 parse the records
first and search no more (3.13.0: 0.15 ms for 8,000 digits). Its record loop is quadratic in
malformed records too, a negative base-256 size sends it backwards (a member list that grows
forever), and a non-UTF-8 `hdrcharset` raises UnicodeDecodeError, which is no `TarError`.

So the header blocks are walked here first, the way `tarfile` walks them (`TarInfo.frombuf` parses
each 512-byte block, so both see the same headers; data is skipped as `tarfile` skips it, pax `size`
records included), and an archive is refused (`TarHeaderProblem`, naming what is wrong and where):
- an extended header (pax `x`/`g`, Solaris `X`, GNU long name/link `L`/`K`) larger than
  MAX_EXTENDED_HEADER_BYTES, or all of them together larger than the caller's bound
  (MAX_EXTENDED_BYTES by default), or more than MAX_EXTENDED_HEADERS_IN_A_ROW before one member;
- a pax header holding a run of more than MAX_DIGIT_RUN ASCII digits, more than MAX_PAX_RECORDS
  records, a record that is not well formed or bytes other than padding after them, a `hdrcharset`
  that is not UTF-8, a `size` in a global header, a negative size, or GNU sparse records (whose maps
  `tarfile` reads from the data, quadratically too);
- a GNU sparse member, a negative size, more members than the caller allows, or more member data than
  its bound (a compressed stream is decompressed no further).
What passes costs `tarfile` time linear in its headers: 3-4 ms per 8 KiB at worst (3.11.7).

Legitimate archives are far inside these bounds: Python's tarfile (any format), GNU tar and bsdtar
write one extended header per member (two for GNU tar's long name and long link), holding a path of
at most PATH_MAX (4096) bytes (a file name of digits has at most NAME_MAX, 255), times
(`mtime=1732895123.123456789`), owners, a size, and xattrs (bsdtar stores them by default, GNU tar
with `--xattrs`: `SCHILY.xattr.<name>=<value>`, or `LIBARCHIVE.xattr.<name>=<base64>`).
"""

import io
import re
import tarfile
from dataclasses import dataclass
from typing import IO

BLOCK = tarfile.BLOCKSIZE

MAX_EXTENDED_HEADER_BYTES = 8 * 1024
"""The most data one extended header may hold: twice PATH_MAX, for a path and a link target."""

MAX_PAX_RECORDS = 64
"""Records in one pax header: a path, a link target, three times, owners, a size, a few xattrs."""

MAX_DIGIT_RUN = 256
"""The longest run of ASCII digits a pax header may hold, in a record's length or in its value alike
(the pre-3.11.10 search costs (run length)² per run wherever it is). Lengths, times, ids and sizes run
to 20 at most; a file name of digits to 255 (NAME_MAX), an xattr's value (bsdtar's default) to a few
hundred. A header of MAX_EXTENDED_HEADER_BYTES filled with runs of this length (the worst case: each
run's cost grows with its square, their number with 1/length) takes tarfile 3.11.7 3-4 ms; with runs
of 32, 64, 128, 512: 0.7, 0.9, 1.6, 9-10 ms; a single run of 8,000 digits, 0.2 s."""

MAX_DIGIT_COST = 8 * 1024 * 1024
"""The sum of (digit run length)² over all of an archive's pax headers: what the pre-3.11.10 search
costs the archive (2-3 ns a unit on 3.11.7: some 20 ms). Runs of 32 digits filling MAX_EXTENDED_BYTES
come to 8.1M (the worst case before MAX_DIGIT_RUN was raised from 32); a header of 8 KiB filled with
runs of 256, 2M (four fit); a 200-digit xattr, 40,000. Without it, MAX_EXTENDED_BYTES of runs of 256
would take 100-140 ms."""

MAX_EXTENDED_HEADERS_IN_A_ROW = 4
"""Extended headers before one member (a global one, a pax one, GNU long name and long link: no tool
writes more). `tarfile` reads each by recursing into the next: a few hundred raise RecursionError."""

MAX_EXTENDED_BYTES = 256 * 1024
"""The data of all of an archive's extended headers together (the default of `check_tar_headers`):
`tarfile` (3.11.7) takes 3-4 ms per 8 KiB of them at worst (runs of MAX_DIGIT_RUN digits
throughout), and MAX_DIGIT_COST bounds the archive's digits together: 15-19 ms at worst (4 such headers,
or 32 of runs of 32 digits). A 100-byte pax header (a path, three times) for each of 2,500 members fits."""

_PAX_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
_GNU_LONG_TYPES = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_EXTENDED_KIND = {
    tarfile.XHDTYPE: "pax extended",
    tarfile.XGLTYPE: "pax global",
    tarfile.SOLARIS_XHDTYPE: "Solaris pax extended",
    tarfile.GNUTYPE_LONGNAME: "GNU long name",
    tarfile.GNUTYPE_LONGLINK: "GNU long link name",
}

MAX_MEMBER_BYTES = 1 << 48
"""A member size past any real archive (256 TiB): refused before the scan seeks past it."""

_DIGIT_RUN = re.compile(rb"[0-9]+")
_RECORD_LENGTH = re.compile(rb"([0-9]{1,20}) ")
_HDRCHARSET = b" hdrcharset="
_DIGITS = frozenset(b"0123456789")


Stream = IO[bytes] | io.BufferedIOBase
"""A file, or what decompresses one (gzip.GzipFile, bz2.BZ2File, lzma.LZMAFile)."""


class TarHeaderProblem(ValueError):
    """The archive is refused before `tarfile` parses it; the message says why."""


@dataclass(frozen=True)
class TarHeaders:
    """What the walk found: the members `tarfile` will list, and the bytes of data they hold."""

    members: int
    data_bytes: int


def _block(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _skip(stream: Stream, count: int) -> None:
    """Move past `count` bytes: a seek where the stream can (a decompressing one reads forward)."""
    if stream.seekable():
        stream.seek(count, io.SEEK_CUR)
        return
    while count > 0:
        chunk = stream.read(min(count, 1024 * 1024))
        if not chunk:
            return
        count -= len(chunk)


def _read_header(stream: Stream) -> tarfile.TarInfo | None:
    """The next header block as `tarfile` parses it, or None where `tarfile` stops (the end-of-archive
    block, the end of the data, a block that is no header) or fails: it reads no further either."""
    try:
        return tarfile.TarInfo.frombuf(stream.read(BLOCK), tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return None


def _pax_records(buf: bytes, where: str) -> dict[bytes, bytes]:
    """The records of a pax header's blocks, parsed as strictly as CPython does since 3.11.10: records
    `"<length> <keyword>=<value>\\n"` back to back up to the first NUL or the end. Where these parse,
    the older lenient loop reads the very same records; anything else is refused."""
    records: dict[bytes, bytes] = {}
    pos = count = 0
    while pos < len(buf) and buf[pos] != 0:
        count += 1
        if count > MAX_PAX_RECORDS:
            raise TarHeaderProblem(f"{where} holds more than {MAX_PAX_RECORDS} records")
        match = _RECORD_LENGTH.match(buf, pos)
        length = int(match[1]) if match else 0
        end = pos + length - 1  # the record's newline
        if match is None or length < 5 or end >= len(buf) or buf[end] != 0x0A:
            raise TarHeaderProblem(f"{where} has a malformed record at byte {pos}")
        keyword, equals, value = buf[match.end() : end].partition(b"=")
        if not keyword or not equals:
            raise TarHeaderProblem(f"{where} has a malformed record at byte {pos}")
        records[keyword] = value  # a keyword given twice: the last one counts, as in tarfile
        pos += length
    # Nothing but padding after the records: tarfile's hdrcharset search scans the blocks whole.
    if buf.count(0, pos) != len(buf) - pos:
        raise TarHeaderProblem(f"{where} holds bytes other than padding after its records (byte {pos})")
    return records


def _hdrcharset(buf: bytes) -> bytes | None:
    """What tarfile before 3.11.10 takes for the header's charset: group 1 of the first match of
    `re.search(rb"\\d+ hdrcharset=([^\\n]+)\\n", buf)`, found in linear time (the search itself is
    quadratic in the header's digit runs). A match's digits run up to " hdrcharset=" (a digit run ends
    at the space), so matches start in the order of those occurrences: the first one preceded by a
    digit and followed by a non-empty line is the search's."""
    at = buf.find(_HDRCHARSET)
    while at != -1:
        start = at + len(_HDRCHARSET)
        if at > 0 and buf[at - 1] in _DIGITS and start < len(buf) and buf[start] != 0x0A:
            end = buf.find(b"\n", start)
            if end == -1:
                return None  # no line ends after this one, nor after any later one
            return buf[start:end]
        at = buf.find(_HDRCHARSET, start)
    return None


def _digit_cost(buf: bytes, where: str) -> int:
    """The header's share of MAX_DIGIT_COST; refused if a run is longer than MAX_DIGIT_RUN."""
    runs = [len(run) for run in _DIGIT_RUN.findall(buf)]
    longest = max(runs, default=0)
    if longest > MAX_DIGIT_RUN:
        raise TarHeaderProblem(
            f"{where} holds a run of {longest} digits (at most {MAX_DIGIT_RUN} are accepted)"
        )
    return sum(n * n for n in runs)


def _check_pax(buf: bytes, *, where: str, is_global: bool) -> int | None:
    """Check a pax header's blocks (all of them, padding included: tarfile searches them whole; their
    digits are counted by `_digit_cost`); the size it gives the member that follows, if any."""
    records = _pax_records(buf, where)
    # What tarfile decodes as UTF-8, raising UnicodeDecodeError out of tarfile.open.
    charset = _hdrcharset(buf)
    if charset is not None:
        try:
            charset.decode("utf-8")
        except UnicodeDecodeError:
            raise TarHeaderProblem(f"{where} has a hdrcharset record that is not UTF-8") from None
    if any(keyword.startswith(b"GNU.sparse.") for keyword in records):
        raise TarHeaderProblem(f"{where} describes a GNU sparse file; sparse members are not accepted")
    if b"size" not in records:
        return None
    if is_global:  # it would move every later member's data: no tool writes one
        raise TarHeaderProblem(f"{where} sets a size for every member")
    try:  # as tarfile reads it: a number Python's int() takes, else 0
        size = int(records[b"size"].decode("utf-8", "surrogateescape"))
    except ValueError:
        size = 0
    if size < 0:
        raise TarHeaderProblem(f"{where} gives a negative size")
    return size


def _read_extended(stream: Stream, header: tarfile.TarInfo, where: str) -> bytes:
    if not 0 <= header.size <= MAX_EXTENDED_HEADER_BYTES:
        raise TarHeaderProblem(
            f"{where} is {header.size} bytes (at most {MAX_EXTENDED_HEADER_BYTES} are accepted)"
        )
    return stream.read(_block(header.size))  # short at the end of the data: tarfile reads as much


def _member_size(size: int, where: str) -> int:
    if size < 0:
        raise TarHeaderProblem(f"{where} gives a negative size")
    if size > MAX_MEMBER_BYTES:  # a seek that far overflows (a 500, where the body's limit was a 413)
        raise TarHeaderProblem(f"{where} gives a size of {size} bytes, more than any archive holds")
    return size


def check_tar_headers(
    stream: Stream,
    *,
    max_members: int,
    max_data_bytes: int | None = None,
    max_extended_bytes: int = MAX_EXTENDED_BYTES,
) -> TarHeaders:
    """Walk the header blocks of the uncompressed tar that `stream` reads from where it stands (a
    decompressing file for a compressed one), as `tarfile` will walk them; TarHeaderProblem, naming
    what is wrong and where, for an archive `tarfile` must not be given (the module's docstring). Data
    is skipped, by seeking where the stream can: the caller seeks back before `tarfile` opens it."""
    offset = members = data_bytes = extended_bytes = digit_cost = 0
    while (header := _read_header(stream)) is not None:
        in_a_row = 0
        pax_size: int | None = None  # the outermost pax `size` of the chain wins in tarfile
        while header.type in _PAX_TYPES or header.type in _GNU_LONG_TYPES:
            where = f"the {_EXTENDED_KIND[header.type]} header at byte {offset}"
            in_a_row += 1
            if in_a_row > MAX_EXTENDED_HEADERS_IN_A_ROW:
                raise TarHeaderProblem(
                    f"{where} is one of more than {MAX_EXTENDED_HEADERS_IN_A_ROW} extended headers in a row"
                )
            buf = _read_extended(stream, header, where)
            extended_bytes += header.size
            if extended_bytes > max_extended_bytes:
                raise TarHeaderProblem(
                    f"{where} takes the archive's extended headers past {max_extended_bytes} bytes"
                )
            if header.type in _PAX_TYPES:
                digit_cost += _digit_cost(buf, where)
                if digit_cost > MAX_DIGIT_COST:
                    raise TarHeaderProblem(
                        f"{where} takes the digits of the archive's pax headers past their bound (the sum "
                        f"of the squares of their runs' lengths, at most {MAX_DIGIT_COST})"
                    )
                size = _check_pax(buf, where=where, is_global=header.type == tarfile.XGLTYPE)
                pax_size = size if pax_size is None else pax_size
            offset += BLOCK + _block(header.size)
            if (header := _read_header(stream)) is None:
                return TarHeaders(members, data_bytes)  # tarfile fails here: "subsequent header"
        where = f"the member header at byte {offset}"
        if header.type == tarfile.GNUTYPE_SPARSE:
            raise TarHeaderProblem(f"{where} is a GNU sparse file; sparse members are not accepted")
        members += 1
        if members > max_members:
            raise TarHeaderProblem(f"{where} is one of more than {max_members} members")
        size = _member_size(header.size if pax_size is None else pax_size, where)
        offset += BLOCK
        # tarfile skips the data of regular files and of types it does not know, and of no other.
        if header.isreg() or header.type not in tarfile.SUPPORTED_TYPES:
            data_bytes += size
            if max_data_bytes is not None and data_bytes > max_data_bytes:
                raise TarHeaderProblem(f"the archive expands beyond {max_data_bytes} bytes")
            _skip(stream, _block(size))
            offset += _block(size)
    return TarHeaders(members, data_bytes)
