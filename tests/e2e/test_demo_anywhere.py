"""`loraloom demo --steps 2` from an empty directory, as a new user runs it: every relative default
(the SQLite URL, the data directory, the output directory) means that directory, and the service and
the pool, started as children, get absolute paths (before the fix the service child ran in the
repository root and found no tables: `no such table: runs`).

The built-in model's cache is shared with the other tests through LORALOOM_MODEL_CACHE (an absolute
path) so that it is built once; about a minute on 2 CPU cores once it is built.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import MODEL_CACHE

pytestmark = pytest.mark.slow


def test_demo_runs_from_an_empty_directory(tmp_path: Path) -> None:
    cwd = tmp_path / "empty"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORALOOM_")}
    env["LORALOOM_MODEL_CACHE"] = str(MODEL_CACHE.resolve())
    loraloom = Path(sys.executable).with_name("loraloom")
    done = subprocess.run(
        [loraloom, "demo", "--steps", "2"], cwd=cwd, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (cwd / ".loraloom" / "demo" / "loraloom.db").is_file()
    assert (cwd / "demo-output" / "results.json").is_file()
    assert (cwd / "demo-output" / "adapters" / "duo-checker" / "adapter_config.json").is_file()
