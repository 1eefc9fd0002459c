"""torchrun (`python -m torch.distributed.run`, same arguments) as the worker pool's launcher, exiting
with the failed rank's own exit code and without a traceback of its own.

A rank that fails says why itself: one line for a setting it cannot run with (exit code 2,
`trainer_core.settings.SettingError`), its traceback for anything else. torchrun then raised
ChildFailedError, which printed some 30 lines of torchrun's own stack and a summary (rank, pid,
exit code) under it, and exited 1 whatever the rank's code was.

A pool stopped by a signal (the demo's clean-up after a Ctrl-C, a `loraloom worker` stopped) logs
one line and exits 128 + the signal's number, as a shell reports it. torchrun logged two warnings
(the signal received, the one sent to each rank) and the same 30-line stack (SignalException).
"""

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

_AGENT_LOG = "torch.distributed.elastic.agent.server.api"
_PROCESSES_LOG = "torch.distributed.elastic.multiprocessing.api"


class _QuietSignalStop(logging.Filter):
    """Drops torchrun's warnings about a stop by signal ("Received 15 death signal, shutting down
    workers", then "Sending process N closing signal SIGTERM" per rank): `run` says it in one line.
    The closing-signal warning is kept when it is not about such a stop (a rank failed and torchrun
    stops the others)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Received %s death signal"):
            self.stopping = True
            return False
        return not (self.stopping and message.startswith("Sending process %s closing signal"))


def run() -> int:
    quiet = _QuietSignalStop()
    for name in (_AGENT_LOG, _PROCESSES_LOG):
        logging.getLogger(name).addFilter(quiet)
    try:
        main()
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        # A negative code is the signal that ended the rank; report it as a shell does (128 + N).
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as exc:
        # torchrun has stopped its ranks with the same signal before it raised this.
        name = signal.Signals(exc.sigval).name
        sys.stderr.write(f"loraloom.torchrun: stopped by {name} (the ranks with it)\n")
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run())
