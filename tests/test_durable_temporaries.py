"""The start-up clean-up of interrupted atomic writes (contracts/durable.py) removes only temporary
files idle for its grace: a second replica sharing the data directory may be writing one now."""

import time
from pathlib import Path

from contracts.durable import TMP_SUFFIX, atomic_write_bytes, remove_stale_temporaries


def test_only_idle_temporary_files_go(tmp_path: Path) -> None:
    run = tmp_path / "run_0123456789ab"
    atomic_write_bytes(run / "config.json", b"{}")
    left = run / f".config.json.deadbeef{TMP_SUFFIX}"  # an interrupted write's leftover
    left.write_bytes(b"half")
    staging = run / f".step_3.cafe0000{TMP_SUFFIX}"  # a directory: the adapters' reconcile owns those
    staging.mkdir()

    # Just written: another process may be about to rename it into place.
    assert remove_stale_temporaries(tmp_path, idle_seconds=3600) == 0
    assert left.exists()

    # An hour and more later nobody writes it any more.
    assert remove_stale_temporaries(tmp_path, idle_seconds=3600, now=time.time() + 3601) == 1
    assert not left.exists()
    assert staging.is_dir() and (run / "config.json").read_bytes() == b"{}"


def test_a_missing_root_is_nothing_to_do(tmp_path: Path) -> None:
    assert remove_stale_temporaries(tmp_path / "absent", idle_seconds=0) == 0
