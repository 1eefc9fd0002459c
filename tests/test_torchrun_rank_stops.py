"""`loraloom.torchrun` when the ranks themselves die of a stop signal: one line, as when torchrun is
signalled (tests/test_embedded_signals.py).

`loraloom worker` passes a Ctrl-C to the ranks (SIGTERM). A rank still building its model has no
handler yet and dies of it; torchrun then logged `failed (exitcode: -15) local_rank: 0 ...` as for a
crash (and a `closing signal` warning for each rank still alive). A rank that fails on its own is
still reported as before. The ranks here are small scripts that wait where a test can signal them.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

RANK = """
import os, pathlib, signal, sys, time
here = pathlib.Path(sys.argv[1])
(here / f"rank-{os.environ['LOCAL_RANK']}").write_text(str(os.getpid()))
if os.environ["LOCAL_RANK"] == "0" and sys.argv[2] == "fail":
    while not (here / "go").exists():
        time.sleep(0.05)
    sys.exit(3)
signal.pause()
"""


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, list[int]]:
    script, log = tmp_path / "rank.py", tmp_path / "pool.log"
    script.write_text(RANK)
    command = [sys.executable, "-m", "loraloom.torchrun", "--nproc-per-node", "2"]
    # A rendezvous on a port torchrun binds itself: one picked free here could be taken meanwhile.
    command += ["--standalone"]
    pool = subprocess.Popen(
        [*command, str(script), str(tmp_path), mode],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    markers = [tmp_path / "rank-0", tmp_path / "rank-1"]
    while not all(m.exists() and m.read_text() for m in markers):  # both ranks wait: torchrun monitors
        assert pool.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.05)
    return pool, log, [int(m.read_text()) for m in markers]


def _wait(pool: subprocess.Popen) -> int:
    try:
        return pool.wait(timeout=60)
    finally:
        if pool.poll() is None:
            os.killpg(pool.pid, signal.SIGKILL)


def test_ranks_that_die_of_a_stop_signal_end_in_the_one_line(tmp_path: Path) -> None:
    """Rank 0 alone is signalled: torchrun sends rank 1 its closing SIGTERM, and said so in a warning
    before the failure line (the order of torchrun's log); both are left out."""
    pool, log, (rank0, _) = _start(tmp_path, "stop")
    os.kill(rank0, signal.SIGTERM)
    assert _wait(pool) == 128 + signal.SIGTERM
    assert log.read_text().splitlines() == ["loraloom.torchrun: stopped by SIGTERM (the ranks with it)"]


def test_a_rank_that_fails_is_still_reported_with_torchruns_lines(tmp_path: Path) -> None:
    """The closing-signal warning held until the failure line says what it is about comes out, in
    torchrun's order: the others stopped, then which rank failed."""
    pool, log, (_, rank1) = _start(tmp_path, "fail")
    (tmp_path / "go").touch()
    assert _wait(pool) == 3
    lines = log.read_text().splitlines()
    closing = [i for i, line in enumerate(lines) if f"Sending process {rank1} closing signal SIGTERM" in line]
    failed = [i for i, line in enumerate(lines) if "failed (exitcode: 3) local_rank: 0" in line]
    assert len(closing) == 1 and len(failed) == 1 and closing[0] < failed[0], lines
    assert not any("stopped by" in line for line in lines), lines
