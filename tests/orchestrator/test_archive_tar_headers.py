"""A downloaded adapter archive's headers are walked, through the decompressor tarfile will use,
before tarfile parses it (contracts/tar_headers.py; hostile probe, 2026-11-29): on Python < 3.11.10
a 141-byte gzip of a pax header holding digits kept `fetch_adapter` for 6 s, and a man in the middle
of plain HTTP could have kept it for hours, whatever its deadlines. Such an archive is now the
SDK's `UnsafeArchive`, naming what is wrong, and nothing is written."""

import bz2
import gzip
import io
import lzma
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from contracts.tar_headers import MAX_EXTENDED_BYTES, MAX_EXTENDED_HEADER_BYTES
from orchestrator.archive import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_MEMBERS,
    UnsafeArchive,
    adapter_dir_tar,
    extract_adapter,
)
from tests.hostile_tars import (
    END,
    extended,
    gzip_polyglot,
    largest_accepted_pax,
    member,
    pax_digit_bomb,
    pax_record,
    refused_archives,
    refusing,
)

COMPRESSIONS: dict[str, Callable[[bytes], bytes]] = {
    "plain": lambda data: data,
    "gzip": lambda data: gzip.compress(data, mtime=0),
    "bzip2": bz2.compress,
    "xz": lzma.compress,
}


@pytest.fixture
def tarfile_parsed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every pax or GNU long-name header tarfile is asked to parse; each is refused as tarfile refuses
    a bad archive."""
    calls: list[str] = []

    monkeypatch.setattr(tarfile.TarInfo, "_proc_pax", refusing(calls, "TarInfo._proc_pax"))
    monkeypatch.setattr(tarfile.TarInfo, "_proc_gnulong", refusing(calls, "TarInfo._proc_gnulong"))
    yield calls


@pytest.fixture
def tarfile_opened(monkeypatch: pytest.MonkeyPatch, tarfile_parsed: list[str]) -> list[str]:
    """As `tarfile_parsed`, and every archive tarfile is asked to open (a negative size sent the
    old code round one member forever)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        tarfile_parsed.append("tarfile.open")
        raise tarfile.ReadError("tarfile.open was called")

    monkeypatch.setattr(tarfile, "open", refuse)
    return tarfile_parsed


def _refused(
    data: bytes,
    tmp_path: Path,
    reason: str,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_members: int = DEFAULT_MAX_MEMBERS,
) -> None:
    dest = tmp_path / "inside" / "adapter"
    with pytest.raises(UnsafeArchive, match="bad adapter archive") as refusal:
        extract_adapter(data, dest, max_bytes=max_bytes, max_members=max_members)
    assert reason in str(refusal.value)
    inside = tmp_path / "inside"  # made only once the headers passed
    assert not inside.exists() or list(inside.iterdir()) == []  # no adapter, no temporary directory


@pytest.mark.parametrize("compression", sorted(COMPRESSIONS))
def test_the_pax_digit_bomb_is_refused_before_tarfile_parses_it(
    tmp_path: Path, tarfile_parsed: list[str], compression: str
) -> None:
    data = COMPRESSIONS[compression](pax_digit_bomb(40_000))
    if compression == "gzip":
        assert len(data) < 200  # the prober's was 141 bytes
    _refused(data, tmp_path, "pax extended header at byte 0 is 40000 bytes")
    assert tarfile_parsed == []


@pytest.mark.parametrize("case", sorted(refused_archives()))
def test_hostile_headers_are_refused_by_name_and_tarfile_never_opens_them(
    tmp_path: Path, tarfile_opened: list[str], case: str
) -> None:
    data, reason = refused_archives()[case]
    _refused(gzip.compress(data, mtime=0), tmp_path, reason)
    assert tarfile_opened == []


def test_a_gzip_that_is_also_a_plain_tar_bomb_is_read_as_gzip_only(
    tmp_path: Path, tarfile_parsed: list[str]
) -> None:
    """Mode "r:*" tried the plain tar held in the gzip header's extra field once the gzip stream
    failed as a tar: the compression is now named by the magic, and only that is read."""
    _refused(gzip_polyglot(), tmp_path, "bad adapter archive")
    assert tarfile_parsed == []


def test_the_sdks_own_bounds_on_members_extended_headers_and_data(
    tmp_path: Path, tarfile_opened: list[str]
) -> None:
    members = b"".join(member(f"m{i}", b"x") for i in range(4)) + END
    _refused(gzip.compress(members), tmp_path, "one of more than 3 members", max_members=3)
    _refused(gzip.compress(members), tmp_path, "the archive expands beyond 3 bytes", max_bytes=3)
    # Member data the header claims is refused before it is decompressed.
    huge = tarfile.TarInfo("adapter_model.safetensors")
    huge.size = 2**40
    _refused(gzip.compress(huge.tobuf() + END), tmp_path, f"expands beyond {2**30} bytes", max_bytes=2**30)
    count = MAX_EXTENDED_BYTES // MAX_EXTENDED_HEADER_BYTES + 1
    headers = b"".join(extended(largest_accepted_pax(run=0)) + member(f"m{i}") for i in range(count)) + END
    _refused(gzip.compress(headers), tmp_path, f"extended headers past {MAX_EXTENDED_BYTES} bytes")
    assert tarfile_opened == []


def _tree(root: Path) -> dict[str, bytes]:
    """Files with long names, within the bounds (a path of ~1,000 bytes, a 200-byte name)."""
    files = {
        "adapter_config.json": b"{}",
        "adapter_model.safetensors": b"w" * 3000,
        "/".join(["d" * 200] * 4) + "/" + "n" * 200 + ".json": b"deep",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


@pytest.mark.parametrize("fmt", ["PAX_FORMAT", "GNU_FORMAT", "USTAR_FORMAT"])
@pytest.mark.parametrize("compression", sorted(COMPRESSIONS))
def test_archives_python_writes_still_extract(tmp_path: Path, fmt: str, compression: str) -> None:
    """tar.add as written by default: float mtimes (a pax header per file in PAX_FORMAT), long names
    as pax paths or GNU long names (ustar splits them at a slash, up to 255 bytes)."""
    files = _tree(tmp_path / "src")
    if fmt == "USTAR_FORMAT":
        files = {n: d for n, d in files.items() if len(n) <= 255}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=getattr(tarfile, fmt)) as tar:
        for name in files:
            tar.add(tmp_path / "src" / name, arcname=name, recursive=False)
    raw = buf.getvalue()
    if fmt == "PAX_FORMAT":
        assert b"mtime=" in raw and b"path=" in raw  # pax headers really are there
    out = extract_adapter(COMPRESSIONS[compression](raw), tmp_path / "out")
    for name, data in files.items():
        assert (out / name).read_bytes() == data


def test_the_sdks_upload_archive_and_the_largest_accepted_header_extract(tmp_path: Path) -> None:
    _tree(tmp_path / "src")
    out = extract_adapter(adapter_dir_tar(tmp_path / "src"), tmp_path / "sdk")
    assert (out / "adapter_model.safetensors").read_bytes() == b"w" * 3000
    at_the_bounds = extended(largest_accepted_pax()) + member("adapter_config.json", b"{}") + END
    out = extract_adapter(gzip.compress(at_the_bounds), tmp_path / "bounds")
    assert (out / "adapter_config.json").read_bytes() == b"{}"
    pax_size = extended(pax_record(b"size", b"2")) + member("adapter_config.json", b"{}") + END
    assert (extract_adapter(pax_size, tmp_path / "size") / "adapter_config.json").read_bytes() == b"{}"
