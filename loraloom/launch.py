"""Child processes of the product: the service under uvicorn and the worker pool under torchrun
(for the CLI, the demo, the end-to-end tests and the benchmarks)."""

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import httpx

from trainer_core.parent_death import LAUNCHER_PID_ENV, signal_on_parent_death
from trainer_core.settings import threads_per_rank

_ROOT = Path(__file__).resolve().parent.parent
"""Where the packages are (the repository, or site-packages for a wheel): the service child imports
`app` from here, never from a same-named directory in the caller's working directory."""

PATH_VARIABLES = ("LORALOOM_DATA_DIR", "LORALOOM_MODEL_CACHE", "LORALOOM_CHECKPOINT_DIR", "LORALOOM_RUNS_DIR")


def absolute_env(env: Mapping[str, str], cwd: Path | None = None) -> dict[str, str]:
    """`env` with every relative LORALOOM_* path (and a relative SQLite URL) made absolute against
    `cwd` (default: the working directory), so that a child sees the same files as its parent
    whatever its own working directory."""
    base = (cwd or Path.cwd()).resolve()
    out = dict(env)
    for name in PATH_VARIABLES:
        value = out.get(name)
        if value and not Path(value).expanduser().is_absolute():
            out[name] = str(base / value)
    url = out.get("LORALOOM_DATABASE_URL")
    if url:
        out["LORALOOM_DATABASE_URL"] = absolute_sqlite_url(url, base)
    return out


def absolute_sqlite_url(url: str, cwd: Path | None = None) -> str:
    """`sqlite:///relative/x.db` → `sqlite:////abs/relative/x.db`; every other URL as it is."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url.startswith(prefix + "/") or url == prefix + ":memory:":
        return url
    return prefix + str((cwd or Path.cwd()).resolve() / url.removeprefix(prefix))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and that anyone may take before the
    caller binds it (another test process did: a flake). Where the caller can retry, or a person
    picks a port; a service child takes `start_service_process(port=0)`, which holds its port from
    the start, and a pool `launch_pool(master_port=0)`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_socket(port: int = 0) -> socket.socket:
    """A socket listening on 127.0.0.1:`port` (0: any free port), for a service child to serve on
    (uvicorn's --fd). Bound here, so the port is ours from this call on: a port picked free and
    closed for the child to bind later could be taken meanwhile (by another test process), and a
    port another server holds fails here, before a child is started. Raises RuntimeError if the
    port is in use."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        # Accepted connections inherit it. uvicorn wraps an --fd socket as AF_UNIX, so asyncio does
        # not set it on them, and a response's body waited for the ACK of its head (Nagle): 24 ms a
        # request against 0.8 ms on loopback.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RuntimeError(
                f"cannot listen on 127.0.0.1:{port}: the port is in use (choose another)"
            ) from None
        raise
    return sock


def start_service_process(
    *,
    env: Mapping[str, str],
    port: int = 0,
    log_path: Path | None = None,
    workers: int = 1,
    timeout_s: float = 60.0,
    app_dir: Path = _ROOT,
    factory: str = "app.main:create_app",
) -> tuple[subprocess.Popen[bytes], str]:
    """Start uvicorn on 127.0.0.1:`port` (0: any free port) in its own process group; return it and
    its URL once /readyz answers. This process binds the port and hands the listening socket to the
    child (`service_socket`): nothing can take the port between the two.

    The service stops (SIGTERM) when this process dies, as the pool does (`launch_pool`), and is
    killed if anything (a Ctrl-C included) interrupts the wait for it: a demo stopped either way
    left its service listening under PID 1.

    `env` is the child's whole environment (LORALOOM_* settings included). Raises RuntimeError,
    with the end of the log when there is one, if the service exits or is not ready in time.
    `app_dir`: the source tree the service's `app` package is imported from (benchmarks start
    another checkout's service beside this one's); `factory`: the app's factory there.
    """
    # The protocol and limits `loraloom serve` uses (app/serving.py), so the demo, the end-to-end
    # tests and the benchmarks run what production runs.
    from app.serving import uvicorn_cli_args

    # Before anything starts: a port another server holds fails here (that server would have answered
    # /readyz before our child failed to bind, and the demo drove it with its own keys).
    sock = service_socket(port)
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child inherits it
    with sock:  # closed here once the child has its copy: the port is free again when it stops
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--factory", factory, "--fd", str(sock.fileno())]
                + ["--workers", str(workers), "--log-level", "warning", "--no-access-log"]
                + [*uvicorn_cli_args(env), "--app-dir", str(app_dir)],
                env=absolute_env(env),
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                pass_fds=(sock.fileno(),),
                start_new_session=True,
                preexec_fn=_dies_with_this_thread(),
            )
        finally:
            if log is not None:
                log.close()
    try:
        _wait_ready(process, url, timeout_s, log_path)
    except BaseException:
        # Not ready in time, exited, or interrupted (KeyboardInterrupt, the demo's SystemExit on
        # SIGTERM): no one else holds the process yet, so it goes here.
        process.kill()
        process.wait()
        raise
    return process, url


def _wait_ready(process: subprocess.Popen[bytes], url: str, timeout_s: float, log_path: Path | None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path else ""
            raise RuntimeError(f"the service exited with {process.returncode}\n{tail}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the service did not become ready in {timeout_s:.0f} s")


def _dies_with_this_thread() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child sent SIGTERM (its graceful stop) when this process dies,
    even by SIGKILL, where no clean-up of ours runs. Linux ties the request to the thread that
    forks, so only from the main thread (from another it would fire when that thread ended)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal_on_parent_death(signal.SIGTERM, parent=os.getpid())


DEFAULT_MASTER_PORT = 29517


def rendezvous_port(nproc_per_node: int, master_port: int | None) -> int | None:
    """The loopback port the ranks meet on: fixed with several ranks (one pool per machine unless a
    port is given); None where torchrun picks a free one itself: one rank without a port, or port 0."""
    if master_port == 0:
        return None
    if nproc_per_node > 1 or master_port is not None:
        return master_port or DEFAULT_MASTER_PORT
    return None


def torchrun_command(
    *, nproc_per_node: int, worker_args: Sequence[str], master_port: int | None = None
) -> list[str]:
    """`master_port`: see `rendezvous_port` (0: any free port)."""
    # torchrun, less its traceback when a rank fails (loraloom.torchrun).
    cmd = [sys.executable, "-m", "loraloom.torchrun", "--nproc-per-node", str(nproc_per_node)]
    port = rendezvous_port(nproc_per_node, master_port)
    if port is not None:
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        # torchrun's own rendezvous store, bound to port 0 by torchrun itself and handed to the
        # ranks as MASTER_PORT: no port is picked free and closed for someone else to take first.
        cmd += ["--standalone"]
    return [*cmd, "-m", "trainer_core.worker", *worker_args]


def pool_env(env: Mapping[str, str], *, nproc_per_node: int) -> dict[str, str]:
    """The pool's environment: `env` with absolute paths (`absolute_env`) and, unless it sets one,
    OMP_NUM_THREADS splitting the cores it may use between the ranks. Left unset, torchrun sets 1 for several
    ranks (and says so in a banner): a CPU pool of 2 ranks on 16 cores used 2 of them."""
    out = absolute_env(env)
    if not out.get("OMP_NUM_THREADS"):
        out["OMP_NUM_THREADS"] = str(threads_per_rank(nproc_per_node))
    return out


def launch_pool(
    *,
    nproc_per_node: int,
    worker_args: Sequence[str],
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start the pool (`master_port`: see `rendezvous_port`; 0: any free port, which torchrun binds
    itself) in its own process group; its ranks die with it (see trainer_core.parent_death),
    and, when called from the main thread, it stops (SIGTERM: each rank finishes its step) when this
    process dies — a `loraloom worker` killed or whose terminal closed left its pool training under
    PID 1. (From another thread it would stop when that thread ends: not asked for then.)"""
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child inherits it
    command = torchrun_command(
        nproc_per_node=nproc_per_node, worker_args=worker_args, master_port=master_port
    )
    try:
        return subprocess.Popen(
            # torchrun's own pid, exported to its ranks (the shell execs into torchrun, keeping its
            # pid): a rank orphaned before it could follow its launcher sees it and exits.
            ["/bin/sh", "-c", f'export {LAUNCHER_PID_ENV}=$$; exec "$@"', "sh", *command],
            env=pool_env({**os.environ, **(env or {})}, nproc_per_node=nproc_per_node),
            start_new_session=True,
            preexec_fn=_dies_with_this_thread(),
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
    finally:
        if log is not None:
            log.close()
