"""Safe extraction of adapter archives (tar.gz of a PEFT directory).

An archive comes from the network, so it is treated as hostile: its headers are walked first,
through the decompressor tarfile will use (`contracts.tar_headers`: none may cost tarfile more than
linear time, as a pax header of digits did before Python 3.11.10); only regular files are written,
never outside the destination (no absolute paths, no `..`, no links, no devices), with caps on size
and member count. Extraction goes to a temporary sibling directory that replaces the destination in
one rename (`contracts.durable.atomic_replace_dir`), so a sampler never sees half an adapter.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import logging
import lzma
import re
import shutil
import tarfile
import uuid
import zlib
from pathlib import Path, PurePosixPath
from typing import IO, Any, Literal

from contracts.durable import atomic_replace_dir
from contracts.tar_headers import Stream, TarHeaderProblem, check_tar_headers
from orchestrator.errors import LoraloomError

log = logging.getLogger(__name__)

MARKER_NAME = ".loraloom-adapter.json"
"""Written next to the adapter files: the ETag (sha256) and step they came from."""
DEFAULT_MAX_BYTES = 8 * 1024**3
DEFAULT_MAX_MEMBERS = 10_000


class UnsafeArchive(LoraloomError):
    """The archive holds something other than plain files inside the destination."""


class DestinationInUse(LoraloomError):
    """The destination exists and holds something other than an adapter: it is not replaced."""


def _check_replaceable(dest: Path) -> None:
    """An adapter replaces its destination whole, so that must be new, empty, or hold only the
    PEFT files (and an earlier extraction's marker): never a directory of the user's other files
    (`fetch_adapter(run, "latest", "~/project")` would have deleted the project)."""
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_symlink() or not dest.is_dir():
        raise DestinationInUse(
            f"{dest} exists and is not a directory: choose a new directory for the adapter"
        )
    # Even an earlier extraction (its marker) is replaced only while it holds nothing else: files
    # added beside the adapter since (a tokenizer, notes) would go with it.
    others = sorted(p.name for p in dest.iterdir() if p.name not in (*PEFT_FILES, MARKER_NAME))
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise DestinationInUse(
            f"{dest} holds other files ({shown}); an adapter replaces its directory whole, so it is "
            "not written there: choose a new or empty directory"
        )


def _safe_relpath(name: str) -> PurePosixPath:
    if "\\" in name or "\x00" in name:
        raise UnsafeArchive(f"archive member {name!r} has a forbidden character")
    path = PurePosixPath(name)
    if path.is_absolute():
        raise UnsafeArchive(f"archive member {name!r} is an absolute path")
    parts = [p for p in path.parts if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise UnsafeArchive(f"archive member {name!r} escapes the destination")
    if not parts:
        raise UnsafeArchive(f"archive member {name!r} has an empty name")
    return PurePosixPath(*parts)


def _plan(
    tar: tarfile.TarFile, max_bytes: int, max_members: int
) -> list[tuple[tarfile.TarInfo, PurePosixPath]]:
    members = tar.getmembers()
    if len(members) > max_members:
        raise UnsafeArchive(f"archive has {len(members)} members (limit {max_members})")
    files: list[tuple[tarfile.TarInfo, PurePosixPath]] = []
    total = 0
    for member in members:
        if member.isdir():
            _safe_relpath(member.name)  # still refuse traversal in names we would ignore
            continue
        if not member.isreg():
            raise UnsafeArchive(f"archive member {member.name!r} is not a regular file")
        rel = _safe_relpath(member.name)
        total += member.size
        if total > max_bytes:
            raise UnsafeArchive(f"archive expands beyond {max_bytes} bytes")
        files.append((member, rel))
    if not files:
        raise UnsafeArchive("archive holds no files")
    # A tar of "step_3/adapter_config.json ..." and one of "adapter_config.json ..." must
    # land the same way: strip a single top-level directory that holds everything.
    tops = {rel.parts[0] for _, rel in files}
    if len(tops) == 1 and all(len(rel.parts) > 1 for _, rel in files):
        files = [(m, PurePosixPath(*rel.parts[1:])) for m, rel in files]
    seen: set[PurePosixPath] = set()
    for _, rel in files:
        if rel in seen:
            raise UnsafeArchive(f"archive holds {rel} twice")
        seen.add(rel)
    return files


TarMode = Literal["r:", "r:gz", "r:bz2", "r:xz"]

# How each compression tarfile reads begins: gzip with deflate; bzip2 with a block size and the magic
# of its first block or of its end (empty); xz. A plain tar begins with its first member's name.
_MAGIC = re.compile(rb"(?P<gz>\x1f\x8b\x08)|(?P<bz2>BZh[1-9](?:1AY&SY|\x17rE8P\x90))|(?P<xz>\xfd7zXZ\x00)")

# What a failing decompressor raises: gzip.BadGzipFile and bz2's "Invalid data stream" are OSErrors
# (without an errno, unlike a failing disk), a truncated stream an EOFError.
_DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


def _tar_mode(fileobj: IO[bytes]) -> TarMode:
    """The compression named by the archive's first bytes (the file is left where it stood)."""
    start = fileobj.tell()
    match = _MAGIC.match(fileobj.read(10))
    fileobj.seek(start)
    kind = match.lastgroup if match else None
    return "r:gz" if kind == "gz" else "r:bz2" if kind == "bz2" else "r:xz" if kind == "xz" else "r:"


def _decompressing(fileobj: IO[bytes], mode: TarMode) -> Stream:
    """The uncompressed stream `tarfile.open(fileobj=fileobj, mode=mode)` reads, by the same classes
    (closing it leaves `fileobj` open)."""
    if mode == "r:gz":
        return gzip.GzipFile(fileobj=fileobj, mode="rb")
    if mode == "r:bz2":
        return bz2.BZ2File(fileobj)
    if mode == "r:xz":
        return lzma.LZMAFile(fileobj)
    return fileobj


def _checked_tar_mode(fileobj: IO[bytes], *, max_bytes: int, max_members: int) -> TarMode:
    """The mode to open the archive in, once its headers passed `check_tar_headers` (none that costs
    tarfile more than linear time: on an old Python a man in the middle could have pinned the caller
    for hours), read through the decompressor tarfile will use and no further than `max_bytes` of
    member data; the file is left where it stood. The compression is named by its magic, not left to
    "r:*": that tries each kind in turn, so a file that fails as the gzip stream it claims to be would
    be parsed again, unchecked, as a plain tar (held in its gzip header's extra field)."""
    start = fileobj.tell()
    mode = _tar_mode(fileobj)
    stream = _decompressing(fileobj, mode)
    try:
        check_tar_headers(stream, max_members=max_members, max_data_bytes=max_bytes)
    except TarHeaderProblem as exc:
        raise UnsafeArchive(f"bad adapter archive: {exc}") from exc
    except _DECOMPRESSION_ERRORS as exc:
        if isinstance(exc, OSError) and exc.errno is not None:
            raise
        raise UnsafeArchive(f"bad adapter archive: {exc}") from exc
    finally:
        if stream is not fileobj:
            stream.close()
    fileobj.seek(start)
    return mode


def read_marker(directory: Path) -> dict[str, Any] | None:
    """What `extract_adapter` recorded about the adapter in `directory`, if anything."""
    try:
        data = json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def extract_adapter(
    data: bytes | IO[bytes],
    dest: Path,
    *,
    sha256: str | None = None,
    step: int | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_members: int = DEFAULT_MAX_MEMBERS,
) -> Path:
    """Extract a (gzipped) tar of adapter files into `dest`, replacing what was there: nothing, an
    empty directory, an earlier extraction or the PEFT files alone (else `DestinationInUse`).
    `data` is the archive's bytes or a seekable file holding it (a download, kept off memory)."""
    dest = Path(dest)
    _check_replaceable(dest)
    fileobj = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    mode = _checked_tar_mode(fileobj, max_bytes=max_bytes, max_members=max_members)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        with tarfile.open(fileobj=fileobj, mode=mode) as tar:
            for member, rel in _plan(tar, max_bytes, max_members):
                target = tmp.joinpath(*rel.parts)
                # Belt and braces: the planned path must stay inside tmp.
                if not target.resolve().is_relative_to(tmp.resolve()):
                    raise UnsafeArchive(f"archive member {member.name!r} escapes the destination")
                target.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is None:
                    raise UnsafeArchive(f"archive member {member.name!r} has no data")
                with source, open(target, "xb") as out:
                    shutil.copyfileobj(source, out)
        (tmp / MARKER_NAME).write_text(json.dumps({"sha256": sha256, "step": step}))
        atomic_replace_dir(tmp, dest)
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error, FileExistsError) as exc:
        # FileExistsError: two members that map to one file (e.g. "a" and "./a").
        shutil.rmtree(tmp, ignore_errors=True)
        raise UnsafeArchive(f"bad adapter archive: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.debug("extracted adapter step=%s into %s", step, dest)
    return dest


PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def adapter_dir_tar(adapter_dir: Path) -> bytes:
    """An uncompressed tar of a PEFT directory's two files (the body of POST /v1/adapters);
    FileNotFoundError, naming the path, when the directory or one of its files is missing."""
    if not Path(adapter_dir).is_dir():
        raise FileNotFoundError(f"adapter directory {adapter_dir} does not exist (or is not a directory)")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in PEFT_FILES:
            path = Path(adapter_dir) / name
            if not path.is_file():
                raise FileNotFoundError(f"{adapter_dir} has no {name}: not a PEFT adapter directory")
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
