"""A test-only pause point of the master, between a step's training and its publish (issue 10).

With `LORALOOM_TEST_PAUSE_FILE=P` in the environment, the master reads P before publishing the steps
an iteration completed. When P names one of those runs, it writes `P.paused` (holding the run id)
and waits until P is removed, then goes on publishing. The lifecycle race tests use it to make a
tenant's evict or delete land exactly inside the window between the state sync and the publish,
while the pool holds the victim's claimed batch. Unset (production), it costs one `os.environ` read.
"""

import logging
import os
import time
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger("loraloom.worker")

PAUSE_ENV = "LORALOOM_TEST_PAUSE_FILE"
POLL_S = 0.05


def paused_marker(path: Path) -> Path:
    """The file the master writes while it holds the pause at `path`."""
    return path.with_name(path.name + ".paused")


def pause_before_publish(run_ids: Collection[str]) -> None:
    """Hold here while the pause file names one of `run_ids` (see the module docstring)."""
    setting = os.environ.get(PAUSE_ENV)
    if not setting:
        return
    path = Path(setting)
    try:
        wanted = path.read_text().strip()
    except FileNotFoundError:
        return
    if wanted not in run_ids:
        return
    marker = paused_marker(path)
    marker.write_text(wanted)
    log.warning("test pause point: holding the publish of %s until %s is removed", wanted, path)
    while path.exists():
        time.sleep(POLL_S)
    marker.unlink(missing_ok=True)
