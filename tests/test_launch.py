"""The worker pool's environment (loraloom/launch.py `pool_env`): torchrun set OMP_NUM_THREADS=1 for
every rank of a multi-rank pool when the caller left it unset, so a CPU pool of 2 ranks on 16 cores
trained on 2 of them."""

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
