"""Adapter archives are extracted safely: regular files only, inside the destination."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from orchestrator.archive import DestinationInUse, UnsafeArchive, extract_adapter, read_marker


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _special(name: str, kind: bytes, target: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


def test_extracts_regular_files_and_records_marker(tmp_path: Path) -> None:
    data = _tar([_file("adapter_config.json", b"{}"), _file("./adapter_model.safetensors", b"w")])
    dest = extract_adapter(data, tmp_path / "a", sha256="abc", step=4)
    assert sorted(p.name for p in dest.iterdir()) == [
        ".loraloom-adapter.json",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert read_marker(dest) == {"sha256": "abc", "step": 4}


def test_single_top_level_directory_is_stripped(tmp_path: Path) -> None:
    dir_info = tarfile.TarInfo("step_3")
    dir_info.type = tarfile.DIRTYPE
    data = _tar([(dir_info, None), _file("step_3/adapter_config.json", b"{}")])
    dest = extract_adapter(data, tmp_path / "a")
    assert (dest / "adapter_config.json").read_bytes() == b"{}"


@pytest.mark.parametrize(
    "member",
    [
        _file("../evil.txt"),
        _file("ok/../../evil.txt"),
        _file("/tmp/evil.txt"),
        _special("link", tarfile.SYMTYPE, "/etc/passwd"),
        _special("hardlink", tarfile.LNKTYPE, "/etc/passwd"),
        _special("dev", tarfile.CHRTYPE),
        _special("fifo", tarfile.FIFOTYPE),
    ],
)
def test_unsafe_members_are_refused_and_nothing_is_written(
    tmp_path: Path, member: tuple[tarfile.TarInfo, bytes | None]
) -> None:
    data = _tar([_file("adapter_config.json", b"{}"), member])
    dest = tmp_path / "inside" / "a"
    with pytest.raises(UnsafeArchive):
        extract_adapter(data, dest)
    assert not dest.exists()
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "inside" / "evil.txt").exists()
    assert list((tmp_path / "inside").iterdir()) == []  # the temporary directory is gone too


def test_existing_adapter_survives_a_bad_archive(tmp_path: Path) -> None:
    dest = extract_adapter(_tar([_file("adapter_config.json", b"v1")]), tmp_path / "a")
    with pytest.raises(UnsafeArchive):
        extract_adapter(b"not a tarball at all", dest)
    assert (dest / "adapter_config.json").read_bytes() == b"v1"


def test_size_cap(tmp_path: Path) -> None:
    with pytest.raises(UnsafeArchive):
        extract_adapter(_tar([_file("big", b"x" * 100)]), tmp_path / "a", max_bytes=10)


def test_a_directory_of_other_files_is_never_replaced(tmp_path: Path) -> None:
    """An adapter replaces its destination whole: a user's project directory given by mistake
    (`fetch_adapter(run, "latest", "~/project")`) would have been deleted."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("precious")
    (project / "adapter_config.json").write_text("{}")
    with pytest.raises(DestinationInUse, match="train.py"):
        extract_adapter(_tar([_file("adapter_config.json", b"{}")]), project)
    assert (project / "train.py").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no staging left behind
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(DestinationInUse, match="not a directory"):
        extract_adapter(_tar([_file("adapter_config.json", b"{}")]), a_file)
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("before", ["missing", "empty", "peft files", "earlier extraction"])
def test_what_an_adapter_may_replace(tmp_path: Path, before: str) -> None:
    dest = tmp_path / "a"
    if before == "empty":
        dest.mkdir()
    elif before == "peft files":
        dest.mkdir()
        (dest / "adapter_model.safetensors").write_bytes(b"old")
    elif before == "earlier extraction":
        extract_adapter(_tar([_file("adapter_config.json", b"v1")]), dest)
    extract_adapter(_tar([_file("adapter_config.json", b"v2")]), dest, step=2)
    assert (dest / "adapter_config.json").read_bytes() == b"v2"
    assert sorted(p.name for p in dest.iterdir()) == [".loraloom-adapter.json", "adapter_config.json"]


def test_files_added_beside_an_earlier_extraction_keep_it_from_being_replaced(tmp_path: Path) -> None:
    dest = extract_adapter(_tar([_file("adapter_config.json", b"v1")]), tmp_path / "a")
    (dest / "tokenizer.json").write_text("mine")
    with pytest.raises(DestinationInUse, match="tokenizer.json"):
        extract_adapter(_tar([_file("adapter_config.json", b"v2")]), dest)
    assert (dest / "tokenizer.json").read_text() == "mine"
    assert (dest / "adapter_config.json").read_bytes() == b"v1"
