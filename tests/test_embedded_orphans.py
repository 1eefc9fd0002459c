"""No child of the embedded stack (`loraloom demo`, the examples) outlives it. Before the fix, a Ctrl-C
(or a SIGTERM) while the service was starting made the demo exit 130 with its uvicorn child
re-parented to PID 1, still listening; and a `kill -9` of the demo stopped the pool (it had a
parent-death signal) but left the service running for good.

The stack runs in a child process whose readiness probe sees the service answer (the test then
signals it) but reports it as still starting: the stop lands in the wait for the service, every
time, with no sleep hoping to hit it.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

STACK_STUCK_STARTING = """
import signal, sys
from pathlib import Path

import httpx

from loraloom.embedded import embedded_stack

# Ctrl-C raises KeyboardInterrupt, as in a terminal, whatever started us (a shell's `&` ignores it).
signal.signal(signal.SIGINT, signal.default_int_handler)
state_dir, port, marker = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
real_get = httpx.get


def answers_but_never_ready(url, **kwargs):
    if real_get(url, **kwargs).status_code == 200 and not marker.exists():
        marker.write_text("the service answers")
    return httpx.Response(503)


httpx.get = answers_but_never_ready  # the readiness probe of loraloom.launch
with embedded_stack(
    state_dir=state_dir, model_cache=state_dir / "models", port=port, slots=1, max_rank=8,
    target_modules=["q_proj"], pack_len=64, say=lambda _line: None,
):
    raise AssertionError("the stack came up")
"""


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc: Linux, as the parent-death signal)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so after the last ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie has exited: only its parent, PID 1 for an orphan, has yet to reap it)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stack_waiting_for_its_service(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A process in `embedded_stack`'s wait for its service, and the service's pid (listening)."""
    marker = tmp_path / "service-answers"
    parent = subprocess.Popen(
        # Port 0: the stack's service takes any free port, held from its pick (loraloom/launch.py).
        [sys.executable, "-c", STACK_STUCK_STARTING, str(tmp_path / "state"), "0", str(marker)],
        cwd=ROOT,
        stdout=(tmp_path / "stack.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 50  # within the stack's own 60 s wait for the service
    while not marker.exists():
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            raise AssertionError((tmp_path / "stack.log").read_text(errors="replace")[-3000:])
        time.sleep(0.05)
    children = _children(parent.pid)
    assert len(children) == 1, children  # uvicorn (one worker: in its own process)
    return parent, children[0]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_the_service_starts_stops_the_service(tmp_path: Path, sig: signal.Signals) -> None:
    parent, service = _stack_waiting_for_its_service(tmp_path)
    try:
        parent.send_signal(sig)
        parent.wait(timeout=30)
        # Stopped and reaped by the stack itself, before it exited.
        assert _gone_within(service, 1), (
            f"the service (pid {service}) outlived the stack stopped by {sig.name}"
        )
    finally:
        if _alive(service):
            os.kill(service, signal.SIGKILL)


def test_the_service_stops_when_the_stack_is_killed(tmp_path: Path) -> None:
    parent, service = _stack_waiting_for_its_service(tmp_path)
    try:
        parent.kill()  # SIGKILL: no clean-up of ours runs; the kernel's parent-death signal does it
        parent.wait()
        assert _gone_within(service, 30), (
            f"the service (pid {service}) outlived the stack killed with SIGKILL"
        )
    finally:
        if _alive(service):
            os.kill(service, signal.SIGKILL)
