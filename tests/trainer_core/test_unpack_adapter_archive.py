"""The pool's unpacking of an adapter the service sends (`init_from`) checks the archive's headers
before `tarfile` reads them (contracts/tar_headers.py), as the service and the SDK do."""

import gzip
import tarfile
from pathlib import Path

import pytest

from contracts.layout import ADAPTER_FILES
from tests.app.test_adapters import tar_bytes
from tests.hostile_tars import pax_digit_bomb
from trainer_core.export import unpack_adapter_archive


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_a_pax_digit_bomb_is_refused_before_tarfile_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compress: bool
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("tarfile parsed the hostile header")

    monkeypatch.setattr(tarfile.TarInfo, "_proc_pax", never)
    data = pax_digit_bomb()
    with pytest.raises(ValueError, match="the adapter archive is refused"):
        unpack_adapter_archive(gzip.compress(data) if compress else data, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("compress", [False, True], ids=["tar", "tar.gz"])
def test_an_adapter_archive_is_unpacked_as_before(tmp_path: Path, compress: bool) -> None:
    files = {name: name.encode() for name in ADAPTER_FILES}
    data = tar_bytes(files)
    out = unpack_adapter_archive(gzip.compress(data) if compress else data, tmp_path / "out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
