"""bench/ingest.py's `event_loop_cpu_seconds`: the CPU of a server process's main thread (its event
loop under single-process uvicorn), and nothing when the process has children (uvicorn
`--workers` > 1, whose main thread only supervises)."""

import os
import subprocess
import sys

from bench.ingest import event_loop_cpu_seconds, tree_cpu_seconds


def test_counts_the_main_thread_only() -> None:
    """Work on another thread raises the process's CPU but not the main thread's figure."""
    code = (
        "import threading, time, sys\n"
        "def spin(s):\n"
        "    end = time.thread_time() + s\n"
        "    while time.thread_time() < end: pass\n"
        "t = threading.Thread(target=spin, args=(0.6,)); t.start(); t.join()\n"
        "spin(0.2)\n"
        "sys.stdout.write('done\\n'); sys.stdout.flush()\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        main = event_loop_cpu_seconds(child.pid)
        total, _system = tree_cpu_seconds(child.pid)
        assert main is not None
        # The main thread spun 0.2 s (plus start-up), the other thread 0.6 s: the process's total
        # holds both, the main thread's figure only its own (clock ticks: 10 ms each).
        assert 0.15 <= main < 0.6, main
        assert total - main >= 0.5, (total, main)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)


def test_none_for_a_process_with_children() -> None:
    """A supervisor (uvicorn --workers N) has children: its main thread is not the event loop."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert event_loop_cpu_seconds(os.getpid()) is None
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
