"""Ctrl-C while the `loraloom` command starts up: exit 130, quietly.

`loraloom.cli` imports typer, httpx, pydantic and the SDK before any command runs (1 to 4 s on a
small machine), and an early Ctrl-C (a mistyped command) printed a 20-line KeyboardInterrupt
traceback from inside those imports. `loraloom.cli` imports this module before anything else: when
the process is the `loraloom` console script (pyproject's [project.scripts]: `loraloom.cli:main`),
SIGINT ends it with exit code 130 and no output, the code a Ctrl-C gets once a command runs.
`started()` (called by `main` before the command line is parsed) puts Python's own handler back, so
commands keep their KeyboardInterrupt handling (a download removing its partial directory, `serve`
and `worker` stopping their processes).

Only the console script: a program or test that imports `loraloom.cli` keeps its own Ctrl-C.
Nothing runs before this module but the packages it is in, which import nothing
(`loraloom/__init__.py` looks its version up only when asked: `importlib.metadata` took 0.1-0.3 s
there, uncovered), and it imports only what the interpreter has loaded already or `signal`. Not
covered: the interpreter's own start (`site`, with an editable install's finder: about 60 ms here),
before any of loraloom runs.
"""

import os
import signal
import sys
from types import FrameType

_received = False
"""Whether a SIGINT came during start-up. Python swallows an exception raised while it runs a
`__del__`, a weakref callback or a garbage collection ("Exception ignored in ..."): a Ctrl-C that
landed there would be lost, and the command would go on (`runs watch` ran until killed), so
`started()` exits for it."""


def _interrupted(signum: int, frame: FrameType | None) -> None:
    # SystemExit, not os._exit: it unwinds the import under way as any exception would, and Python
    # then exits as usual (nothing was written yet, nothing of the command started).
    global _received
    _received = True
    raise SystemExit(130)


def _is_console_script() -> bool:
    """Whether this process runs the `loraloom` script (pip's wrapper, whose file is bin/loraloom)."""
    main = sys.modules.get("__main__")
    name = os.path.basename(getattr(main, "__file__", None) or "")
    return os.path.splitext(name)[0] == "loraloom"  # as Path.stem: pathlib may not be imported yet


# Only over Python's default handler: a SIGINT the caller set to be ignored (nohup, a background job)
# stays ignored.
GUARDED = _is_console_script() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
if GUARDED:
    signal.signal(signal.SIGINT, _interrupted)


def started() -> None:
    """The CLI is imported: Ctrl-C is a KeyboardInterrupt again, handled per command; or, if one came
    during start-up and was swallowed (see `_received`), the process exits 130 now."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _received:
        raise SystemExit(130)
