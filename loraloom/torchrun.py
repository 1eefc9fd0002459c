"""torchrun (`python -m torch.distributed.run`, same arguments) as the worker pool's launcher, exiting
with the failed rank's own exit code and without a traceback of its own.

A rank that fails says why itself: one line for a setting it cannot run with (exit code 2,
`trainer_core.settings.SettingError`), its traceback for anything else. torchrun then raised
ChildFailedError, which printed some 30 lines of torchrun's own stack and a summary (rank, pid,
exit code) under it, and exited 1 whatever the rank's code was.

A pool stopped by a signal (the demo's clean-up after a Ctrl-C, a `loraloom worker` stopped) logs
one line and exits 128 + the signal's number, as a shell reports it. torchrun logged two warnings
(the signal received, the one sent to each rank) and the same 30-line stack (SignalException).
So does a pool whose ranks were stopped by such a signal before they could stop on their own
(`loraloom worker` signals the ranks, and one building its model dies of it): torchrun logged
"failed (exitcode: -15)" as for a crash.
"""

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

_AGENT_LOG = "torch.distributed.elastic.agent.server.api"
_PROCESSES_LOG = "torch.distributed.elastic.multiprocessing.api"

_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""What stops a pool (`loraloom worker` passes on Ctrl-C, SIGTERM and SIGHUP), as against a crash."""


def _stop_signal(exitcode: object) -> signal.Signals | None:
    """The stop signal a rank's exit code (minus the signal's number) says it died of, else None."""
    if isinstance(exitcode, int) and exitcode < 0 and -exitcode in _STOP_SIGNALS:
        return signal.Signals(-exitcode)
    return None


class _QuietSignalStop(logging.Filter):
    """Drops torchrun's warnings about a stop by signal ("Received 15 death signal, shutting down
    workers", then "Sending process N closing signal SIGTERM" per rank), and its "failed (exitcode:
    -15)" error for ranks that died of a stop signal (then the closing-signal warnings it sent just
    before): `run` says it in one line. The closing-signal warnings are kept when they are not about
    such a stop (a rank failed and torchrun stops the others); they come before the failure that
    says which, so they are held until it (`flush` gives back any held at the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False
        self._held: list[logging.LogRecord] = []
        self._released: set[logging.LogRecord] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Received %s death signal"):
            self.stopping = True
            return False
        if message.startswith("Sending process %s closing signal") and record not in self._released:
            if not self.stopping:
                self._held.append(record)
            return False
        if message.startswith("failed (exitcode: %s)"):
            if isinstance(record.args, tuple) and _stop_signal(record.args[0]) is not None:
                self.stopping = True
                self._held.clear()
                return False
            self.flush()  # a failure: the warnings first, in torchrun's order
        return True

    def flush(self) -> None:
        held, self._held = self._held, []
        for record in held:
            self._released.add(record)
            logging.getLogger(record.name).handle(record)


def run() -> int:
    quiet = _QuietSignalStop()
    for name in (_AGENT_LOG, _PROCESSES_LOG):
        logging.getLogger(name).addFilter(quiet)
    try:
        main()
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        stopped_by = _stop_signal(failure.exitcode)
        if stopped_by is not None:
            # The ranks died of the stop signal itself (they had no handler yet): the same one line.
            sys.stderr.write(f"loraloom.torchrun: stopped by {stopped_by.name} (the ranks with it)\n")
        # A negative code is the signal that ended the rank; report it as a shell does (128 + N).
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as exc:
        # torchrun has stopped its ranks with the same signal before it raised this.
        name = signal.Signals(exc.sigval).name
        sys.stderr.write(f"loraloom.torchrun: stopped by {name} (the ranks with it)\n")
        return 128 + int(exc.sigval)
    finally:
        quiet.flush()
    return 0


if __name__ == "__main__":
    sys.exit(run())
