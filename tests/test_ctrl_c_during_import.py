"""Ctrl-C at the very start of the `loraloom` command exits 130 quietly, from its first import on.

The guard (`loraloom.commands.startup`, the first import of `loraloom.cli`) covered the CLI's own
imports, but the `loraloom` package is imported before it, and its `__init__` imported
`importlib.metadata` for `__version__` (0.1-0.3 s): a Ctrl-C there printed a KeyboardInterrupt
traceback. Real processes, paused inside that import by a `sitecustomize`
(tests/test_cli_inputs.py's helpers), then sent SIGINT; none is waited on without a timeout."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli_inputs import LORALOOM, _default_sigint, _interrupt_while_importing


def _new_modules(code: str) -> set[str]:
    """The modules that importing `code` (an import statement) loads, in a fresh interpreter."""
    probe = (
        f"import sys\nbefore = set(sys.modules)\n{code}\nprint(' '.join(sorted(set(sys.modules) - before)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, preexec_fn=_default_sigint
    )
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_nothing_but_the_guard_and_signal_is_imported_before_the_guard() -> None:
    """What the console script runs before the guard is installed: the packages holding it and the
    guard's own `signal`. `importlib.metadata` (with email, csv, zipfile...) was among them."""
    before_guard = _new_modules("import loraloom.commands.startup")
    ours = {"loraloom", "loraloom.commands", "loraloom.commands.startup"}
    assert before_guard - ours <= _new_modules("import signal"), sorted(before_guard - ours)


def test_the_version_is_still_there_when_asked_for() -> None:
    import importlib.metadata

    import loraloom

    assert loraloom.__version__ == importlib.metadata.version("loraloom")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        loraloom.nope  # noqa: B018  (the attribute access is the test)


def test_ctrl_c_while_the_loraloom_package_imports_exits_130_quietly(tmp_path: Path) -> None:
    """Paused in the first import of `importlib.metadata`: `loraloom/__init__.py`'s, before the
    guard, until the package stopped importing it; now `loraloom.cli`'s, after the guard."""
    if not LORALOOM.exists():
        pytest.skip(f"no installed loraloom command at {LORALOOM} (make install)")
    at_start = subprocess.run(
        [sys.executable, "-c", "import sys; print('importlib.metadata' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if at_start.stdout.strip() != "False":
        pytest.skip("this interpreter imports importlib.metadata at its start: no pause point there")
    done = _interrupt_while_importing([str(LORALOOM)], tmp_path, "importlib.metadata")
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "")


PAUSE_IN_A_FINALIZER = """\
import os, signal, sys

class Finalized:
    # Pauses in a __del__: Python swallows what a __del__ raises ("Exception ignored in ..."), so the
    # guard's SystemExit is lost there, as it was when a Ctrl-C landed in a garbage collection.
    def __del__(self):
        os.write(1, b"paused\\n")
        signal.pause()

class PauseAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ.get("LORALOOM_TEST_PAUSE_AT"):
            sys.meta_path.remove(self)
            Finalized()  # collected at once: its __del__ runs here
        return None

sys.meta_path.insert(0, PauseAtImport())
"""


def test_a_ctrl_c_swallowed_during_start_up_still_exits_130(tmp_path: Path) -> None:
    """A SIGINT whose SystemExit Python swallowed (it landed in a `__del__`) used to be lost: the
    command went on (`runs watch` ran until killed). `started()` now exits 130 for it."""
    if not LORALOOM.exists():
        pytest.skip(f"no installed loraloom command at {LORALOOM} (make install)")
    done = _interrupt_while_importing([str(LORALOOM)], tmp_path, "typer", pause=PAUSE_IN_A_FINALIZER)
    assert "SystemExit" in done.stderr  # Python's own "Exception ignored" report: the exit was swallowed
    assert (done.returncode, done.stdout) == (130, "")  # and the version was not printed
