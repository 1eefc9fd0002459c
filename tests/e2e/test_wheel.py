"""The product as a new user installs it: the wheel in a fresh virtualenv, used from an empty directory.

Built from a copy of the sources (a `build/` left in the checkout would leak stale modules into the
wheel), installed without the `worker` extra: `db upgrade`, `serve` and `--version` need no torch,
and this is exactly what the API image installs. pip reuses its wheel cache and the machine's local
index, so the install takes about half a minute on 2 cores.
"""

import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SOURCES_IGNORED = shutil.ignore_patterns(
    ".venv", ".git", "build", "dist", "*.egg-info", ".loraloom", "__pycache__", ".*_cache",
    ".hypothesis", "tests", "bench", "docs", "demo-output",
)  # fmt: skip


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv with the freshly built wheel; yields its bin/ directory."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=SOURCES_IGNORED)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            base / "dist",
            src,
        ],
        check=True,
    )
    (wheel,) = (base / "dist").glob("loraloom-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "app/migrations/env.py" in names and any(
        n.startswith("app/migrations/versions/0001") for n in names
    )
    subprocess.run([sys.executable, "-m", "venv", base / "venv"], check=True)
    subprocess.run([base / "venv" / "bin" / "pip", "install", "-q", wheel], check=True)
    yield base / "venv" / "bin"


def _clean_env() -> dict[str, str]:
    """The caller's environment without our settings or a path into the checkout."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LORALOOM_", "PYTHON", "VIRTUAL_ENV")) and k != "PYTHONPATH"
    }


def test_the_wheel_migrates_serves_and_says_its_version(installed: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _clean_env()

    def loraloom(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [installed / "loraloom", *args], cwd=empty, env=env, capture_output=True, text=True, timeout=120
        )

    version = loraloom("--version")
    assert version.returncode == 0 and version.stdout.strip() == "loraloom 0.1.0", version

    # The installed package, not the checkout; and no torch (the API image's install).
    where = subprocess.run(
        [installed / "python", "-c", "import app, importlib.util; print(app.__file__, importlib.util.find_spec('torch'))"],
        cwd=empty, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "site-packages" in where and where.strip().endswith("None"), where

    upgraded = loraloom("db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert (empty / ".loraloom" / "loraloom.db").is_file()  # the default SQLite URL, in the caller's cwd

    # Port 0: serve binds a free one and says which (uvicorn's "running on" line). A port picked free
    # here could be taken by the other xdist worker before serve bound it.
    log = tmp_path / "serve.log"
    with log.open("wb") as stderr:  # the child has its own copy
        server = subprocess.Popen(
            [installed / "loraloom", "serve", "--port", "0"],
            cwd=empty,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, log.read_text(errors="replace")
            listening = re.search(
                r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace")
            )
            url = listening[1] if listening else None
            try:
                if url is not None and (r := httpx.get(f"{url}/readyz", timeout=2)).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve did not answer /readyz in 60 s"
            time.sleep(0.2)
        assert r.json() == {"status": "ready"}
        # Served from the database `db upgrade` made: the tables are there.
        assert httpx.get(f"{url}/v1/tenants", timeout=5).status_code == 401
    finally:
        server.terminate()
        server.wait(timeout=30)
    # Neither secret is set here: serve says what that disables (the 403s pointed at the caller's key).
    said = log.read_text(errors="replace")
    assert "note: LORALOOM_ADMIN_KEY is not set: admin routes" in said, said
    assert "note: LORALOOM_WORKER_TOKEN is not set: no worker pool can connect" in said, said
