"""`loraloom demo` and the examples start the service and the pool in sessions of their own, so a
SIGTERM or SIGHUP to the parent must unwind through its clean-up instead of killing it outright
(seen before the fix: the service and the pool outlived a SIGTERM'd demo)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loraloom.embedded import signals_as_exit


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_unwinds_and_the_old_handler_comes_back(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    cleaned = False
    with pytest.raises(SystemExit) as stopped:
        try:
            with signals_as_exit():
                os.kill(os.getpid(), sig)
                signal.sigtimedwait([], 0)  # let the handler run before the next line
                raise AssertionError("the signal did not stop the block")
        finally:
            cleaned = True
    assert cleaned and stopped.value.code == 128 + sig
    assert signal.getsignal(sig) == before


RANK_THAT_WAITS = "import pathlib, signal, sys; pathlib.Path(sys.argv[1]).write_text('up'); signal.pause()"


@pytest.mark.slow
def test_a_pool_stopped_by_a_signal_logs_one_line(tmp_path: Path) -> None:
    """The demo's clean-up after a Ctrl-C stops the pool with SIGTERM: its worker.log then held
    torchrun's two warnings and its 30-line SignalException traceback (README: loraloom.torchrun
    strips torchrun's tracebacks)."""
    marker, rank, log = tmp_path / "rank-up", tmp_path / "rank.py", tmp_path / "worker.log"
    rank.write_text(RANK_THAT_WAITS)
    pool = subprocess.Popen(
        [sys.executable, "-m", "loraloom.torchrun", "--nproc-per-node", "1", str(rank), str(marker)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():  # the rank runs: torchrun is in its monitoring loop
            assert pool.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if pool.poll() is None:
            os.killpg(pool.pid, signal.SIGKILL)
    assert log.read_text().splitlines() == ["loraloom.torchrun: stopped by SIGTERM (the ranks with it)"]
