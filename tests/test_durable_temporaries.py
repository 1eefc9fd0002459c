"""Interrupted atomic writes (contracts/durable.py): the start-up removes every temporary file (a
crash leaves nothing half-written behind a restart); names beside a file say whose they are."""

import time
from pathlib import Path

from contracts.durable import (
    OLD_SUFFIX,
    TMP_SUFFIX,
    atomic_write_bytes,
    beside,
    final_name_of,
    remove_stale_temporaries,
    untouched,
)


def test_every_temporary_file_goes_and_nothing_else(tmp_path: Path) -> None:
    run = tmp_path / "run_0123456789ab"
    atomic_write_bytes(run / "config.json", b"{}")
    left = run / f".config.json.deadbeef{TMP_SUFFIX}"  # an interrupted write's leftover, just made
    left.write_bytes(b"half")
    staging = run / f".step_3.cafe0000{TMP_SUFFIX}"  # a directory: the adapters' reconcile owns those
    staging.mkdir()

    assert remove_stale_temporaries(tmp_path) == 1
    assert not left.exists()
    assert staging.is_dir() and (run / "config.json").read_bytes() == b"{}"


def test_a_missing_root_is_nothing_to_do(tmp_path: Path) -> None:
    assert remove_stale_temporaries(tmp_path / "absent") == 0


def test_a_name_beside_a_file_says_whose_it_is(tmp_path: Path) -> None:
    """The reconcile pass (app/adapters/reconcile.py) finds the staging directories, replaced copies
    and temporaries it may remove by the names `beside` makes: one definition for both ends."""
    for final in (tmp_path / "step_3", tmp_path / "adapter_step_3_0123456789abcdef.tar.gz"):
        for suffix in (TMP_SUFFIX, OLD_SUFFIX):
            assert final_name_of(beside(final, suffix).name) == final.name
    for other in (
        "step_3",
        ".step_3.tmp",
        ".step_3.DEADBEEF.tmp",
        ".step_3.deadbeef.bak",
        ".step_3.deadbeef.tmp\n",
    ):
        assert final_name_of(other) is None


def test_untouched_is_false_for_what_changed_since_or_is_gone(tmp_path: Path) -> None:
    staging = tmp_path / ".step_3.deadbeef.tmp"
    staging.mkdir()
    (staging / "adapter_model.safetensors").write_bytes(b"\0")
    now = time.time()
    assert untouched(staging, since=now + 10) and not untouched(staging, since=now - 10)
    assert not untouched(tmp_path / "gone", since=now + 10)  # gone: left alone
