"""A rank dies with its torchrun launcher (stdlib only: it must run before the seconds of torch imports).

torchrun starts every rank in a session of its own, so neither a signal to the launcher's process
group nor the launcher's death reaches the ranks. Without this an orphaned rank would keep
training on leases the service already handed to a new pool (or, killed while it was still
importing torch, hang in the rendezvous under PID 1 for half an hour: seen in the chaos test).
"""

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable
from typing import cast

PR_SET_PDEATHSIG = 1
LAUNCHER_PID_ENV = "LORALOOM_LAUNCHER_PID"
"""The pid of torchrun, set by `loraloom.launch.launch_pool`: a rank whose parent is no longer it was
orphaned before it could ask to die with it (killed within the rank's interpreter start-up)."""


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies; exit now if the parent already has."""
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    parent = int(launcher) if launcher.isdigit() else os.getppid()
    signal_on_parent_death(signal.SIGKILL, parent=parent)()


def signal_on_parent_death(signum: int, *, parent: int) -> Callable[[], None]:
    """A function that, run in a child (as a `preexec_fn`: after the fork, before the exec, which keeps
    the request) or in this process, has Linux send it `signum` when its parent (the thread that
    started it) dies, and exits at once if the parent, which should be `parent`, is gone already.
    libc is opened here, in the caller: a dlopen between a fork and an exec could wait forever on a
    loader lock another thread of the parent held at the fork."""
    prctl = _prctl()

    def request() -> None:
        if prctl is not None:
            with contextlib.suppress(OSError):
                prctl(PR_SET_PDEATHSIG, int(signum))
        if os.getppid() != parent:
            os._exit(1)  # the parent is already gone: nothing would ever stop this process

    return request


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return cast(Callable[..., int], ctypes.CDLL("libc.so.6", use_errno=True).prctl)
    except (OSError, AttributeError):
        return None
