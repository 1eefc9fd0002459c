"""Test-only pause points of the master: between a step's training and its publish (issue 10),
and named places of the manual work (issue 16: a pool killed there must lose nothing).

With `LORALOOM_TEST_PAUSE_FILE=P` in the environment, the master reads P before publishing the steps
an iteration completed. When P names one of those runs, it writes `P.paused` (holding the run id)
and waits until P is removed, then goes on publishing. The lifecycle race tests use it to make a
tenant's evict or delete land exactly inside the window between the state sync and the publish,
while the pool holds the victim's claimed batch. `pause_at(point)` holds the same way when P names
`point` (the points below); the crash tests SIGKILL the pool while it holds there. Unset (production),
each costs one `os.environ` read.
"""

import logging
import os
import time
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger("loraloom.worker")

PAUSE_ENV = "LORALOOM_TEST_PAUSE_FILE"
POLL_S = 0.05

MANUAL_BEFORE_CLAIM = "manual:before-claim"
"""Before each claim of manual work: after the previous claim's results were reported."""
MANUAL_BEFORE_OPTIM = "manual:before-optim"
"""After the passes of a claim were reported, before its optim_steps update the adapters."""
MANUAL_BEFORE_OPTIM_REPORT = "manual:before-optim-report"
"""After the optim_steps updated, published and checkpointed the adapters, before their report."""
STARTUP_BEFORE_MODEL = "startup:before-model"
"""At start-up, before the master loads (or builds) the base model: before any stop handler."""


def paused_marker(path: Path) -> Path:
    """The file the master writes while it holds the pause at `path`."""
    return path.with_name(path.name + ".paused")


def pause_before_publish(run_ids: Collection[str]) -> None:
    """Hold here while the pause file names one of `run_ids` (see the module docstring)."""
    _hold_while_named(run_ids)


def pause_at(point: str) -> None:
    """Hold here while the pause file names `point` (see the module docstring)."""
    _hold_while_named((point,))


def _hold_while_named(names: Collection[str]) -> None:
    setting = os.environ.get(PAUSE_ENV)
    if not setting:
        return
    path = Path(setting)
    try:
        wanted = path.read_text().strip()
    except FileNotFoundError:
        return
    if wanted not in names:
        return
    marker = paused_marker(path)
    marker.write_text(wanted)
    log.warning("test pause point: holding at %s until %s is removed", wanted, path)
    while path.exists():
        time.sleep(POLL_S)
    marker.unlink(missing_ok=True)
