"""The worker pool's environment (loraloom/launch.py `pool_env`): torchrun set OMP_NUM_THREADS=1 for
every rank of a multi-rank pool when the caller left it unset, so a CPU pool of 2 ranks on 16 cores
trained on 2 of them."""

import os
import socket
from pathlib import Path

import pytest

from loraloom import launch
from trainer_core import settings


@pytest.mark.parametrize(("cores", "ranks", "threads"), [(16, 2, "8"), (16, 1, "16"), (2, 4, "1")])
def test_the_pool_splits_the_cores_between_its_ranks(monkeypatch, cores: int, ranks: int, threads: str):
    # The cores it may run on (a container pinned to 2 of 64 CPUs has 2), not the host's.
    monkeypatch.setattr(settings.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(settings.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    env = launch.pool_env({"PATH": "/bin", "OMP_NUM_THREADS": ""}, nproc_per_node=ranks)
    assert env["OMP_NUM_THREADS"] == threads
    assert env["PATH"] == "/bin"


def test_a_thread_count_the_caller_set_is_kept_and_paths_made_absolute(monkeypatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)
    env = launch.pool_env({"OMP_NUM_THREADS": "3", "LORALOOM_DATA_DIR": "data"}, nproc_per_node=2)
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["LORALOOM_DATA_DIR"] == str(tmp_path.resolve() / "data")


def test_a_service_is_not_started_on_a_port_another_server_answers_on(tmp_path: Path):
    """`loraloom demo --port P` with P taken read the other server's /readyz as its own service's and
    drove that service (with the demo's keys) while its own uvicorn had failed to bind."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            launch.start_service_process(env=dict(os.environ), port=port, log_path=tmp_path / "service.log")
    assert not (tmp_path / "service.log").exists()  # nothing was started
