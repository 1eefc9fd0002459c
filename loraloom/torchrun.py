"""torchrun (`python -m torch.distributed.run`, same arguments) as the worker pool's launcher, exiting
with the failed rank's own exit code and without a traceback of its own.

A rank that fails says why itself: one line for a setting it cannot run with (exit code 2,
`trainer_core.settings.SettingError`), its traceback for anything else. torchrun then raised
ChildFailedError, which printed some 30 lines of torchrun's own stack and a summary (rank, pid,
exit code) under it, and exited 1 whatever the rank's code was.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


def run() -> int:
    try:
        main()
    except ChildFailedError as exc:
        _, failure = exc.get_first_failure()
        # A negative code is the signal that ended the rank; report it as a shell does (128 + N).
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0


if __name__ == "__main__":
    sys.exit(run())
