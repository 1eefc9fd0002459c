"""The ports of the product's children (loraloom/launch.py) are never picked free and closed for the
child to bind later: under pytest-xdist another test process took such a port in between, at times,
and the service or the pool failed to start. The service's socket is bound and listening before its
child starts (the child gets it as a file descriptor); a pool on port 0 leaves the port to torchrun,
which binds its rendezvous store itself."""

import errno
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from loraloom import launch


def test_the_service_port_is_held_before_its_child_starts(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A competitor tries to take the port at the worst moment, as the child is started: before, the
    port was free then (checked, not held), the competitor got it and the child failed to bind."""
    # Bound but not listening, with SO_REUSEADDR: on Linux the service can bind the same port beside
    # it, and whichever listens first holds it. So the number is reserved for this test alone.
    competitor = socket.socket()
    competitor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    competitor.bind(("127.0.0.1", 0))
    port = competitor.getsockname()[1]
    tries: list[str] = []
    real_popen = subprocess.Popen

    def popen_after_a_competitor(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        try:
            competitor.listen()
            tries.append("the competitor took the port")
        except OSError as exc:
            tries.append(errno.errorcode[exc.errno or 0])
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(launch.subprocess, "Popen", popen_after_a_competitor)
    env = {**os.environ, "LORALOOM_DATABASE_URL": database_url, "LORALOOM_DATA_DIR": str(tmp_path / "data")}
    with competitor:
        process, url = launch.start_service_process(env=env, port=port, log_path=tmp_path / "service.log")
        try:
            assert tries == ["EADDRINUSE"]
            assert url == f"http://127.0.0.1:{port}"
            assert httpx.get(f"{url}/readyz", timeout=10).json() == {"status": "ready"}
        finally:
            process.terminate()
            process.wait(timeout=30)


def test_port_0_is_a_free_port_held_from_the_start() -> None:
    with launch.service_socket() as held:
        port = held.getsockname()[1]
        assert port != 0
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            launch.service_socket(port)


def test_a_pool_on_port_0_leaves_the_port_to_torchrun() -> None:
    """--standalone: torchrun binds its rendezvous store to port 0 and hands the ranks the port it
    got (MASTER_PORT); --master-port would be bound by torchrun seconds after it was picked."""
    command = launch.torchrun_command(nproc_per_node=2, worker_args=["--slots", "2"], master_port=0)
    assert "--standalone" in command and "--master-port" not in command
    assert launch.rendezvous_port(2, 0) is None  # nothing for `loraloom worker` to check first
    # A port the user gives, and the default with several ranks, are as before.
    fixed = launch.torchrun_command(nproc_per_node=2, worker_args=[], master_port=29600)
    assert fixed[fixed.index("--master-port") + 1] == "29600" and "--standalone" not in fixed
    default = launch.torchrun_command(nproc_per_node=2, worker_args=[])
    assert default[default.index("--master-port") + 1] == str(launch.DEFAULT_MASTER_PORT)
