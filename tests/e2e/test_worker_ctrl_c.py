"""Ctrl-C of `loraloom worker` stops the whole pool and gives its leases back at once (issue 10).

The real CLI launches torchrun with 2 gloo ranks against the real service, whose pool timeout is long
(120 s) so that only the pool's deregistration can make its leases pending again. SIGINT to the
CLI (what a terminal's Ctrl-C sends it): within 10 s no process of the pool is left (the CLI,
torchrun, every rank: each in its own session, so they are found by parentage before the signal),
and no batch is claimed any more. Two SIGINTs: the second kills at once. The worker token is on no
process's command line.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.common import WORKER_TOKEN
from tests.e2e.conftest import start_service
from tests.e2e.helpers import (
    MODEL_CACHE,
    TORCHRUN_PICKS_THE_PORT,
    kill_pool,
    run_config,
    start_pool,
    synthetic_batch,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres_only]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its parent, the test, has not reaped it yet)


def _start_worker(url: str, data_dir: Path, log_path: Path) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("loraloom")), "worker", "--url", url]
    command += ["--nproc-per-node", "2", "--slots", "2"]
    command += ["--seq-len", "64", "--max-rank", "8", "--model-cache-dir", str(MODEL_CACHE)]
    command += ["--poll-interval", "0.1", "--pack-timeout", "0.5"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "LORALOOM_WORKER_TOKEN": WORKER_TOKEN,
        "LORALOOM_DATA_DIR": str(data_dir),
        **TORCHRUN_PICKS_THE_PORT,
    }
    with open(log_path, "ab") as log:
        # Its own session: the test signals the CLI alone, as a terminal signals its foreground job.
        return subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _batches(client: httpx.Client, run_id: str) -> list[dict]:
    return client.get(f"/v1/runs/{run_id}/batches", params={"limit": 200}).json()["items"]


def _training(client: httpx.Client, run_id: str, worker: subprocess.Popen, log_path: Path) -> set[int]:
    """Wait until this pool trains and holds leases; its processes (CLI, torchrun, ranks)."""
    wait_for(lambda: " step " in log_path.read_text(errors="replace"), timeout=180, what="a step")
    wait_for(
        lambda: any(b["state"] == "claimed" for b in _batches(client, run_id)), timeout=60, what="a lease"
    )
    pids = {worker.pid, *_descendants(worker.pid)}
    assert len(pids) >= 4, pids  # the CLI, torchrun, two ranks
    for pid in pids:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        assert WORKER_TOKEN.encode() not in cmdline, f"the token is on the command line of {pid}"
    return pids


def _gone_within(pids: set[int], worker: subprocess.Popen, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        worker.poll()  # reap the CLI
        if not any(_alive(pid) for pid in pids):
            return time.monotonic() - start
        time.sleep(0.05)
    left = {pid: (Path("/proc") / str(pid) / "cmdline").read_bytes()[:200] for pid in pids if _alive(pid)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"pool processes left after {seconds} s: {left}")


def test_ctrl_c_stops_every_process_and_returns_the_leases(database_url, tmp_path):
    service = start_service(
        database_url=database_url,
        data_dir=tmp_path / "data",
        extra_env={"LORALOOM_MAX_CONCURRENT_RUNS": "2", "LORALOOM_POOL_TIMEOUT_SECONDS": "120"},
    )
    try:
        client = service.tenant_client("ctrl-c")
        run = client.post("/v1/runs", json={"name": "long", "config": run_config(max_steps=1000)}).json()[
            "id"
        ]
        for seed in range(60):
            r = client.post(f"/v1/runs/{run}/batches", json=synthetic_batch(seed, n_samples=4))
            assert r.status_code == 201, r.text

        # Two Ctrl-C: the second kills at once.
        worker = _start_worker(service.url, service.data_dir, tmp_path / "worker1.log")
        pids = _training(client, run, worker, tmp_path / "worker1.log")
        os.kill(worker.pid, signal.SIGINT)
        os.kill(worker.pid, signal.SIGINT)
        _gone_within(pids, worker, 10)

        # One Ctrl-C: the pool stops after its step and deregisters.
        worker = _start_worker(service.url, service.data_dir, tmp_path / "worker2.log")
        pids = _training(client, run, worker, tmp_path / "worker2.log")
        os.kill(worker.pid, signal.SIGINT)
        took = _gone_within(pids, worker, 10)
        states = [b["state"] for b in _batches(client, run)]
        assert "claimed" not in states, states  # at once: the pool timeout is 120 s
        log = (tmp_path / "worker2.log").read_text(errors="replace")
        assert "pool deregistered" in log
        # The ranks were signalled, not torchrun: no traceback per rank, and a clean exit.
        assert "Traceback" not in log and worker.returncode == 0, log[-3000:]
        print(f"single Ctrl-C: every pool process gone in {took:.2f} s")
    finally:
        service.stop()


def _start_directory_worker(tmp_path: Path, log_path: Path) -> subprocess.Popen:
    """`loraloom worker` on an empty runs directory (no service), in a session of its own."""
    (tmp_path / "runs").mkdir(exist_ok=True)
    command = [
        str(Path(sys.executable).with_name("loraloom")),
        "worker",
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    command += ["--model-cache-dir", str(MODEL_CACHE), "--poll-interval", "0.1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["kill -9", "terminal closed"])
def test_a_launcher_killed_or_hung_up_takes_its_pool_with_it(tmp_path, sig):
    """The pool runs in a session of its own, so neither the CLI's death nor its terminal's hang-up
    reached it: torchrun and its rank trained on under PID 1, and the service still saw the pool
    alive. Now torchrun is told when the CLI dies (SIGTERM: each rank finishes its step), and a
    SIGHUP is passed on like Ctrl-C."""
    log_path = tmp_path / "worker.log"
    worker = _start_directory_worker(tmp_path, log_path)
    try:
        wait_for(
            lambda: "training the runs" in log_path.read_text(errors="replace"), timeout=180, what="the pool"
        )
        pids = {worker.pid, *_descendants(worker.pid)}
        assert len(pids) >= 3, pids  # the CLI, torchrun, the rank
        os.kill(worker.pid, sig)
        took = _gone_within(pids, worker, 30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
    if sig == signal.SIGHUP:
        log = log_path.read_text(errors="replace")
        assert worker.returncode == 0 and "Traceback" not in log, log[-3000:]
    print(f"{sig.name}: every pool process gone in {took:.2f} s")


def test_ranks_die_with_a_launcher_killed_while_they_import_torch(tmp_path):
    """kill -9 of torchrun while its ranks are still starting (importing torch, seconds): they must
    not live on under PID 1 (the chaos test's restarts left such ranks hanging in the rendezvous)."""
    pool = start_pool("http://127.0.0.1:9", data_dir=tmp_path, log_path=tmp_path / "pool.log")
    try:

        def ranks() -> set[int]:
            return {
                pid
                for pid in _descendants(pool.pid)
                if b"trainer_core.worker" in (Path("/proc") / str(pid) / "cmdline").read_bytes()
            }

        started = wait_for(lambda: len(ranks()) >= 2 and ranks(), timeout=60, interval=0.05, what="2 ranks")
    finally:
        kill_pool(pool)
    took = _gone_within(started, pool, 10)
    print(f"ranks gone {took:.2f} s after kill -9 of their launcher mid-import")
