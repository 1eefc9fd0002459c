"""The whole system on one machine, embedded: SQLite, the service as a subprocess and a one-rank CPU
worker pool (for `loraloom demo` and `examples/`).

`embedded_stack(...)` wipes `state_dir`, migrates a SQLite database there, starts the service and the
pool, yields an `EmbeddedStack` (its URL, the admin key, `create_tenant`), and stops both on exit.

No child outlives the stack's process: however it stops (Ctrl-C or SIGTERM at any moment, start-up
included) the clean-up runs, and if it dies without one (SIGKILL) each child is sent SIGTERM by the
kernel (a parent-death signal, loraloom/launch.py). Before, a Ctrl-C while the service was starting,
or a kill -9 of the demo, left the service listening under PID 1.
"""

import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class EmbeddedStack:
    url: str
    admin_key: str
    state_dir: Path
    """Absolute: the database, the service's artifacts (`data/`), the logs."""

    def create_tenant(self, name: str, *, max_concurrent_runs: int = 3) -> str:
        """A new tenant; returns an API key of it."""
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.admin_key}"}) as admin:
            response = admin.post(
                "/v1/tenants", json={"name": name, "max_concurrent_runs": max_concurrent_runs}
            )
            response.raise_for_status()
            key = admin.post(f"/v1/tenants/{response.json()['id']}/keys")
            key.raise_for_status()
            return str(key.json()["key"])


@contextmanager
def embedded_stack(
    *,
    state_dir: Path,
    model_cache: Path,
    port: int,
    slots: int,
    max_rank: int,
    target_modules: Sequence[str],
    pack_len: int,
    max_concurrent_runs: int = 4,
    say: Callable[[str], None] = print,
) -> Iterator[EmbeddedStack]:
    """Service + one-rank pool on a fresh SQLite database under `state_dir` (wiped first)."""
    from app.migrate import upgrade
    from loraloom.launch import launch_pool, start_service_process

    # Relative paths mean the caller's working directory, resolved once here: every child gets
    # absolute ones (the service and the pool must see the same database and files).
    state_dir, model_cache = state_dir.expanduser().resolve(), model_cache.expanduser().resolve()
    shutil.rmtree(state_dir, ignore_errors=True)
    state_dir.mkdir(parents=True)
    admin_key, worker_token = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    db_url = f"sqlite:///{state_dir / 'loraloom.db'}"
    env = {
        **os.environ,
        "LORALOOM_DATABASE_URL": db_url,
        "LORALOOM_DATA_DIR": str(state_dir / "data"),
        "LORALOOM_ADMIN_KEY": admin_key,
        "LORALOOM_WORKER_TOKEN": worker_token,
        "LORALOOM_MAX_CONCURRENT_RUNS": str(max_concurrent_runs),
        "OMP_NUM_THREADS": "1",
    }
    say(f"[embedded] database {db_url}; artifacts under {state_dir / 'data'}")
    upgrade(db_url)
    service: subprocess.Popen[bytes] | None = None
    pool: subprocess.Popen[bytes] | None = None
    # The children run in sessions of their own (a terminal's Ctrl-C reaches only us): whatever stops
    # us must go through the `finally` below, or the service and the pool outlive us. From before the
    # first child starts: a SIGTERM during start-up (its default kills us at once) skipped it.
    stops = signals_as_exit() if threading.current_thread() is threading.main_thread() else nullcontext()
    with stops:
        try:
            service, url = start_service_process(env=env, port=port, log_path=state_dir / "service.log")
            say(f"[embedded] service up at {url}")
            pool = launch_pool(
                nproc_per_node=1,
                worker_args=[
                    "--url",
                    url,
                    "--slots",
                    str(slots),
                    "--seq-len",
                    str(pack_len),
                    "--max-rank",
                    str(max_rank),
                    "--target-modules",
                    ",".join(target_modules),
                    "--checkpoint-dir",
                    str(state_dir / "data" / "runs"),
                    "--model-cache-dir",
                    str(model_cache),
                    "--pack-timeout",
                    "0.3",
                    "--poll-interval",
                    "0.05",
                ],
                # The token in the environment, never on a command line (`ps` shows those).
                env={"OMP_NUM_THREADS": "1", "LORALOOM_WORKER_TOKEN": worker_token},
                log_path=state_dir / "worker.log",
            )
            say(f"[embedded] worker pool started (1 CPU rank); log: {state_dir / 'worker.log'}")
            yield EmbeddedStack(url=url, admin_key=admin_key, state_dir=state_dir)
        finally:
            # The pool first: its ranks finish their step, which they report to the service. Nested,
            # so that a second Ctrl-C while the pool stops still stops the service.
            try:
                _stop(pool)
            finally:
                _stop(service)


def _stop(process: subprocess.Popen[bytes] | None, timeout_s: float = 20) -> None:
    """SIGTERM (a graceful stop), SIGKILL if it has not ended within `timeout_s`."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def signals_as_exit() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit while the stack is up (their default kills the process at
    once, skipping the clean-up); the previous handlers come back after."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
