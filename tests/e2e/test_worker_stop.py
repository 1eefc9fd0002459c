"""Ctrl-C of `loraloom worker` where the pool cannot stop the usual way (README "Stopping").

- The service is down: the pool was retrying a request (24 attempts, about a minute) and went on
  retrying after the Ctrl-C, then ended in RetryExhausted's 60-line traceback and exit 130. Now the
  retry gives up at the stop: the pool says in one line that it stops without the service, tries
  to deregister once, and exits 0 within seconds.
- The pool is still building its model: no stop handler yet, so each rank died of the SIGTERM and
  torchrun logged `failed (exitcode: -15)`. Now that is the documented one line,
  `loraloom.torchrun: stopped by SIGTERM (the ranks with it)`, and exit 130.

Both are deterministic: the Ctrl-C comes once the log shows the retry, or once the master holds at
the test pause point before its model (`trainer_core.pause_point`); the guard timeouts only bound
the wait for a test that fails.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import start_service
from tests.e2e.helpers import MODEL_CACHE, TORCHRUN_PICKS_THE_PORT, wait_for
from tests.e2e.test_worker_ctrl_c import _descendants, _gone_within, _start_worker
from trainer_core.pause_point import PAUSE_ENV, STARTUP_BEFORE_MODEL, paused_marker

pytestmark = pytest.mark.slow

TORCHRUN_STOP_LINE = "loraloom.torchrun: stopped by SIGTERM (the ranks with it)"
MAIN_LOOP_RETRY = re.compile(r"(GET|POST) /v1/pool/(?!heartbeat)\S+: attempt \d+/24 failed")
"""A retry of the loop's own requests (state sync, Tinker claim), not of the heartbeat thread's."""


def test_ctrl_c_while_the_service_is_down_stops_at_once(database_url, tmp_path):
    service = start_service(database_url=database_url, data_dir=tmp_path / "data")
    log_path = tmp_path / "worker.log"
    worker = None
    try:
        worker = _start_worker(service.url, service.data_dir, log_path)
        wait_for(
            lambda: "registered pool" in log_path.read_text(errors="replace"), timeout=180, what="the pool"
        )
        service.stop()
        # The master's loop retries a request (the retry loop's warning comes before each pause).
        wait_for(
            lambda: MAIN_LOOP_RETRY.search(log_path.read_text(errors="replace")),
            timeout=60,
            interval=0.1,
            what="a retry of the pool's loop",
        )
        pids = {worker.pid, *_descendants(worker.pid)}
        assert len(pids) >= 4, pids  # the CLI, torchrun, two ranks
        os.kill(worker.pid, signal.SIGINT)
        # 20 s bounds the wait only: the retries left would have taken about a minute.
        _gone_within(pids, worker, 20)
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.pid, signal.SIGKILL)
        service.stop()
    log = log_path.read_text(errors="replace")
    assert worker.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "gave up after" not in log, log[-3000:]
    assert "rank 0: stopping without the service: " in log, log[-3000:]
    assert "deregistering the pool failed" in log, log[-3000:]  # tried once, did not wait on it
    assert "rank 0: stopped" in log and "rank 1: stopped" in log, log[-3000:]


def test_ctrl_c_while_the_pool_builds_its_model_ends_in_the_one_line(tmp_path):
    """Directory mode (no service needed); two ranks: the master holds before its model, the other
    waits for it in a collective, where only the signal's default action can stop it."""
    pause, log_path = tmp_path / "pause", tmp_path / "worker.log"
    pause.write_text(STARTUP_BEFORE_MODEL)
    (tmp_path / "runs").mkdir()
    command = [
        str(Path(sys.executable).with_name("loraloom")),
        "worker",
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    command += ["--nproc-per-node", "2", "--seq-len", "64"]
    command += ["--model-cache-dir", str(MODEL_CACHE)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", PAUSE_ENV: str(pause)}
    env |= TORCHRUN_PICKS_THE_PORT
    with open(log_path, "ab") as log_file:
        worker = subprocess.Popen(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for(paused_marker(pause).exists, timeout=180, interval=0.1, what="the pause before the model")
        pids = {worker.pid, *_descendants(worker.pid)}
        assert len(pids) >= 4, pids  # the CLI, torchrun, two ranks
        os.kill(worker.pid, signal.SIGINT)
        _gone_within(pids, worker, 20)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
    log = log_path.read_text(errors="replace")
    assert worker.returncode == 128 + signal.SIGINT, log[-3000:]  # as a shell reports a Ctrl-C
    assert TORCHRUN_STOP_LINE in log.splitlines(), log[-3000:]
    for torchrun_said in ("failed (exitcode", "closing signal", "Traceback"):
        assert torchrun_said not in log, log[-3000:]
    assert "base model loaded" not in log  # the stop came during the start-up indeed
