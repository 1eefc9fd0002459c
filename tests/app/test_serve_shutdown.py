"""`loraloom serve` stops promptly on SIGTERM or Ctrl-C while clients watch runs. Before, uvicorn
logged "Waiting for connections to close" and went on sending keepalives to every open event
stream (the API's and the dashboard's, each lasting up to an hour) until its client left: the
service never exited. Now the streams end, cleanly, once the shutdown begins
(app/shutdown.py), and `LORALOOM_SHUTDOWN_TIMEOUT_SECONDS` bounds whatever else runs.

The test holds the property by the order of events, not by a time bound (on 2 shared cores those
are flaky): the streams' clients never leave by themselves (no read timeout, no close), so a server
that waited for them could only exit at its graceful-shutdown bound (120 s here), cutting them and
logging that it did; this one exits with the streams ended by the server itself, cleanly."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.config import Settings
from app.serving import SHUTDOWN_TIMEOUT_ENV, shutdown_timeout_seconds, uvicorn_cli_args, uvicorn_options
from tests.app.api import create_run, new_tenant
from tests.common import ADMIN_KEY, WORKER_TOKEN

ROOT = Path(__file__).resolve().parents[2]
SSE = {"Accept": "text/event-stream"}
EXIT_GUARD_S = 60
"""A hang guard only (the server exits within a second or two of the signal), and below the 120 s
graceful-shutdown bound: a server that waited for its streams' clients fails here, at once named."""
LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")
"""What `loraloom serve` (uvicorn) logs once it listens, with the port it got for --port 0."""


class Stream:
    """An event stream read in a thread: the events' names, and how it ended. The client has no read
    timeout and never hangs up: only the server (or its process ending) ends the stream."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.events: list[str] = []
        self.ended_cleanly = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(url, headers), daemon=True)
        self.thread.start()

    def _read(self, url: str, headers: dict[str, str]) -> None:
        try:
            timeout = httpx.Timeout(30, read=None)
            with httpx.Client(timeout=timeout) as client, client.stream("GET", url, headers=headers) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        self.events.append(line.removeprefix("event: "))
            self.ended_cleanly = True  # the whole chunked body: the server ended it, not a reset
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def wait_for(self, event: str, within: float = 30) -> None:
        deadline = time.monotonic() + within
        while event not in self.events:
            assert self.thread.is_alive() and time.monotonic() < deadline, (self.events, self.error)
            time.sleep(0.02)


def _serve(settings: Settings, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {
        **os.environ,
        "LORALOOM_DATABASE_URL": settings.database_url,
        "LORALOOM_DATA_DIR": str(settings.data_dir),
        "LORALOOM_ADMIN_KEY": ADMIN_KEY,
        "LORALOOM_WORKER_TOKEN": WORKER_TOKEN,
        # Far longer than the bound below: the streams must end by themselves, not be cut.
        SHUTDOWN_TIMEOUT_ENV: "120",
    }
    # Port 0: the server binds a free one and says which. A port picked free here could be taken by
    # the other xdist worker before the server bound it.
    log = tmp_path / "serve.log"
    server = subprocess.Popen(
        [sys.executable, "-c", "from loraloom.cli import main; main()", "serve"]
        + ["--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()
        listening = LISTENING.search(log.read_text(errors="replace"))
        try:
            if listening and httpx.get(f"{listening[1]}/readyz", timeout=1).status_code == 200:
                return server, listening[1]
        except httpx.TransportError:
            pass
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_server_exits_promptly_while_event_streams_are_open(
    settings: Settings, tmp_path: Path, sig: signal.Signals
) -> None:
    server, url = _serve(settings, tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            tenant = new_tenant(http)
            run = create_run(http, tenant)
            api = Stream(f"{url}/v1/runs/{run['id']}/events", tenant.headers | SSE)
            assert http.post("/ui/login", data={"key": tenant.key}).status_code in (200, 303)
            cookie = {"Cookie": "; ".join(f"{k}={v}" for k, v in http.cookies.items())}
            ui = Stream(f"{url}/ui/runs/{run['id']}/events", cookie | SSE)
            api.wait_for("run.admitted")
            ui.wait_for("run.admitted")

        # Both streams are open when the signal goes (their clients stay for ever).
        assert api.thread.is_alive() and ui.thread.is_alive(), (api.error, ui.error)
        server.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=EXIT_GUARD_S)  # before the fix: for as long as the clients stayed
        exited = server.poll() is not None
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert exited, f"{sig.name}: the server waited for its streams' clients (still running)\n{log}"
    for stream in (api, ui):
        stream.thread.join(timeout=30)  # a hang guard: the process is gone, its sockets closed
        # The whole chunked body: the server ended the stream (its clients never leave by
        # themselves), where a server cut at its graceful bound, or killed, resets it.
        assert stream.ended_cleanly, (stream.error, log)
    assert "timeout graceful shutdown exceeded" not in log


def test_the_shutdown_bound_is_a_setting_every_server_gets() -> None:
    default = Settings.model_fields["shutdown_timeout_seconds"].default
    assert default == 10
    assert uvicorn_options({})["timeout_graceful_shutdown"] == default
    assert uvicorn_options({SHUTDOWN_TIMEOUT_ENV: "3"})["timeout_graceful_shutdown"] == 3
    args = uvicorn_cli_args({SHUTDOWN_TIMEOUT_ENV: "7"})  # the demo's and the benchmarks' services
    assert args[args.index("--timeout-graceful-shutdown") + 1] == "7"


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "soon", "3601"])
def test_a_bad_shutdown_bound_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=f"^{SHUTDOWN_TIMEOUT_ENV}='{value}': "):
        shutdown_timeout_seconds({SHUTDOWN_TIMEOUT_ENV: value})
