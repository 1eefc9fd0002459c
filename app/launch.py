"""Run the service as a child process: for the demo, the end-to-end tests and the benchmarks."""

import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service_process(
    *,
    env: Mapping[str, str],
    port: int,
    log_path: Path | None = None,
    workers: int = 1,
    timeout_s: float = 60.0,
) -> tuple[subprocess.Popen, str]:
    """Start uvicorn on 127.0.0.1:`port` in its own process group; return once /readyz answers.

    `env` is the child's whole environment (LORALOOM_* settings included). Raises RuntimeError,
    with the end of the log when there is one, if the service exits or is not ready in time.
    """
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child inherits it
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--factory", "app.main:create_app", "--host", "127.0.0.1"]
            + ["--port", str(port), "--workers", str(workers), "--log-level", "warning", "--no-access-log"],
            cwd=_ROOT,
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
        )
    finally:
        if log is not None:
            log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise RuntimeError(f"the service exited with {process.returncode}\n{tail}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the service did not become ready in {timeout_s:.0f} s")
