"""Legitimate long digit runs pass the header check (contracts/tar_headers.py): bsdtar stores xattrs in
pax records by default (GNU tar with `--xattrs`), and a value of 200 digits, a path of 100-digit
directories or a file name of 255 digits (NAME_MAX) was refused by the former bound of 32 digits.
tarfile before 3.11.10 costs (run length)² per digit run wherever it is, values included, so the bound
stays, at 256: an 8 KiB header of such runs takes it 3-4 ms; and the archive's runs together are
bounded (the sum of their squares, MAX_DIGIT_COST), so that many such headers cannot add up to more than
the 32-digit bound allowed. The check's own search for `hdrcharset` is linear now, and finds what
tarfile's regex finds."""

import gzip
import io
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from contracts.tar_headers import (
    MAX_DIGIT_COST,
    MAX_DIGIT_RUN,
    TarHeaderProblem,
    _hdrcharset,
    check_tar_headers,
)
from orchestrator.archive import MARKER_NAME, extract_adapter
from tests.hostile_tars import END, extended, largest_accepted_pax, member, pax_record

DIGITS_100, DIGITS_200 = "1" * 100, "7" * 200
CONFIG = b'{"r": 8}'


def _pax_tar(files: dict[str, bytes], pax_headers: dict[str, str]) -> bytes:
    """As bsdtar writes a file with an xattr: a pax header holding `SCHILY.xattr.<name>=<value>`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1732895123.123456789
            info.pax_headers = dict(pax_headers)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


LEGITIMATE = {
    "an xattr of 200 digits": ({"adapter_config.json": CONFIG}, {"SCHILY.xattr.user.x": DIGITS_200}),
    "100-digit directories": (
        {"adapter_config.json": CONFIG, f"{DIGITS_100}/{DIGITS_100}/weights.bin": b"w" * 700},
        {},
    ),
    "a file name of 255 digits": (
        {"adapter_config.json": CONFIG, "9" * 255: b"w" * 700},
        {"SCHILY.xattr.user.checksum": "3" * 255},
    ),
}


def _unpacked(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in out.rglob("*")
        if p.is_file() and p.name != MARKER_NAME
    }


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
@pytest.mark.parametrize("case", sorted(LEGITIMATE))
def test_long_digit_runs_in_paths_and_xattrs_pass_and_unpack(
    tmp_path: Path, case: str, compress: bool
) -> None:
    files, pax_headers = LEGITIMATE[case]
    raw = _pax_tar(files, pax_headers)
    longest = max(len(run) for run in re.findall(rb"[0-9]+", raw))
    assert 32 < longest <= MAX_DIGIT_RUN  # refused by the former bound, within this one
    assert check_tar_headers(io.BytesIO(raw), max_members=8).members == len(files)
    out = extract_adapter(gzip.compress(raw) if compress else raw, tmp_path / "out")
    assert _unpacked(out) == files
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:  # the xattr really is in the archive
        assert all(m.pax_headers.items() >= pax_headers.items() for m in tar.getmembers())


def test_a_run_past_the_bound_in_an_xattr_value_is_still_refused() -> None:
    raw = _pax_tar({"adapter_config.json": CONFIG}, {"SCHILY.xattr.user.x": "7" * (MAX_DIGIT_RUN + 1)})
    with pytest.raises(TarHeaderProblem, match=f"holds a run of {MAX_DIGIT_RUN + 1} digits"):
        check_tar_headers(io.BytesIO(raw), max_members=8)


def _xattrs_supported(path: Path) -> bool:
    try:
        os.setxattr(path, "user.htar", b"1")
    except OSError:
        return False
    return True


@pytest.mark.parametrize("tool", ["tar", "bsdtar"])
def test_an_archive_the_real_tool_writes_with_xattrs_and_digit_paths_passes(
    tmp_path: Path, tool: str
) -> None:
    """GNU tar (`--xattrs --format=posix`) and bsdtar (xattrs by default) write pax headers with
    `SCHILY.xattr.user.x` and `path` records; the 100-digit directories and the 200-digit value
    were refused before."""
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    src = tmp_path / "src"
    files = {"adapter_config.json": CONFIG, f"{DIGITS_100}/{DIGITS_100}/{DIGITS_100}/weights.bin": b"w" * 700}
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    if not _xattrs_supported(src / "adapter_config.json"):
        pytest.skip(f"{tmp_path} has no user xattrs")
    os.setxattr(src / "adapter_config.json", "user.x", DIGITS_200.encode())
    options = ["--xattrs", "--format=posix"] if tool == "tar" else ["--format=pax"]
    raw = subprocess.run(
        [tool, *options, "-cf", "-", "-C", str(src), "adapter_config.json", DIGITS_100],
        check=True,
        capture_output=True,
    ).stdout
    assert f"SCHILY.xattr.user.x={DIGITS_200}\n".encode() in raw  # the tool really wrote the xattr
    assert f"path={DIGITS_100}/{DIGITS_100}/".encode() in raw
    check_tar_headers(io.BytesIO(raw), max_members=8)
    out = extract_adapter(raw, tmp_path / "out")
    assert _unpacked(out) == files


HDRCHARSET = re.compile(rb"\d+ hdrcharset=([^\n]+)\n")
"""The search of tarfile before 3.11.10 (quadratic in digit runs), the oracle of the linear one."""


@pytest.mark.parametrize(
    "buf",
    [
        pax_record(b"hdrcharset", b"BINARY"),
        pax_record(b"path", b"a") + pax_record(b"hdrcharset", b"BINARY") + b"\0" * 100,
        # One inside another record's value comes first: tarfile takes that one.
        pax_record(b"comment", b"x 12 hdrcharset=\xff\xfe y") + pax_record(b"hdrcharset", b"BINARY"),
        # Not preceded by a digit, an empty line, then the real one.
        pax_record(b"comment", b"a hdrcharset=x 1 hdrcharset=\n") + pax_record(b"hdrcharset", b"UTF8"),
        b"1 hdrcharset=no line end",
        b" hdrcharset=x\n9 hdrcharset=\n",
        b"7" * MAX_DIGIT_RUN + b" hdrcharset=" * 3 + b"v\n",
        pax_record(b"path", b"1" * MAX_DIGIT_RUN),
        b"",
    ],
)
def test_the_linear_hdrcharset_search_finds_what_tarfiles_regex_finds(buf: bytes) -> None:
    match = HDRCHARSET.search(buf)
    assert _hdrcharset(buf) == (match[1] if match else None)


def test_the_archives_digit_runs_together_are_bounded() -> None:
    """Headers of the longest runs each pass alone; past MAX_DIGIT_COST together, the archive is
    refused, naming the header that crossed it, before tarfile sees any."""
    one = extended(largest_accepted_pax())
    per_header = sum(len(run) ** 2 for run in re.findall(rb"[0-9]+", one))
    fit = MAX_DIGIT_COST // per_header
    assert fit >= 2  # a few such headers are fine
    within = b"".join(one + member(f"m{i}") for i in range(fit)) + END
    assert check_tar_headers(io.BytesIO(within), max_members=100).members == fit
    past = b"".join(one + member(f"m{i}") for i in range(fit + 1)) + END
    with pytest.raises(TarHeaderProblem, match=r"past their bound .*at most 8388608") as refused:
        check_tar_headers(io.BytesIO(past), max_members=100)
    assert f"at byte {fit * (len(one) + 512)}" in str(refused.value)
