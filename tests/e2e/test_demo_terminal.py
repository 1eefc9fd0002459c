"""`loraloom demo --steps 2` on a terminal (a pty, 200 columns): what the terminal shows has every
`[demo] ...` line whole and every progress bar on a row of its own. Before the fix, the lines
printed while the bars were live ("[demo] bob created run duo-solver ...", "[demo] validation before
training ...") landed at the end of a bar's row. tests/test_demo_lines.py checks the printing helper
alone; this is the demo as a user watches it (about 30 s once the built-in model is cached).
"""

import fcntl
import os
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from tests.e2e.helpers import MODEL_CACHE
from tests.test_demo_lines import terminal

pytestmark = pytest.mark.slow

BARS = ("arith-grpo", "arith-rloo", "duo-solver", "duo-checker")


def _on_a_terminal(
    args: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 900
) -> tuple[int, str]:
    """Run `args` with a pty of 200 columns as stdin, stdout and stderr; its exit code and output."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env)
    os.close(slave)
    out, ended = bytearray(), False
    try:
        while not ended:
            ready, _, _ = select.select([master], [], [], timeout_s)
            if not ready:
                raise TimeoutError(f"no output for {timeout_s} s")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every end of the pty's other side is closed
                chunk = b""
            out += chunk
            ended = not chunk
    finally:
        os.close(master)
        if not ended:  # timed out: the demo stops its service and pool on SIGTERM
            process.terminate()
        code = process.wait(timeout=60)
    # The pty turns each newline into CR LF (onlcr): back to LF; tqdm's lone CRs stay.
    return code, out.decode("utf-8", errors="replace").replace("\r\n", "\n")


def test_the_demos_lines_and_bars_each_have_their_row(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORALOOM_")}
    env["LORALOOM_MODEL_CACHE"] = str(MODEL_CACHE.resolve())
    loraloom = Path(sys.executable).with_name("loraloom")
    code, output = _on_a_terminal([str(loraloom), "demo", "--steps", "2"], tmp_path, env)
    rows = terminal(output)
    assert code == 0, "\n".join(rows[-40:])
    demo_rows = [row for row in rows if "[demo]" in row]
    assert all(row.startswith("[demo] ") for row in demo_rows), demo_rows
    for line in ("[demo] bob created run duo-checker (", "[demo] validation before training ("):
        assert any(row.startswith(line) for row in demo_rows), demo_rows
    # Each run's bar, finished, on its own row: nothing printed over it or after it.
    for name in BARS:
        (bar,) = [row for row in rows if row.startswith(f"{name:12s}:")]
        assert "2/2 [" in bar and bar.endswith("]"), bar
