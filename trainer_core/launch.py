"""Start the worker pool under torchrun (what `loraloom worker` runs)."""

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def torchrun_command(
    *, nproc_per_node: int, worker_args: Sequence[str], master_port: int | None = None
) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc_per_node)]
    if nproc_per_node > 1 or master_port is not None:
        # A fixed rendezvous on loopback: one pool per machine unless a port is given.
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(master_port or 29517)]
    return [*cmd, "-m", "trainer_core.worker", *worker_args]


def launch_pool(
    *,
    nproc_per_node: int,
    worker_args: Sequence[str],
    master_port: int | None = None,
    env: dict | None = None,
    log_path: Path | None = None,
) -> subprocess.Popen:
    """Start the pool in its own process group; its ranks die with it (see worker._die_with_parent)."""
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child inherits it
    try:
        return subprocess.Popen(
            torchrun_command(nproc_per_node=nproc_per_node, worker_args=worker_args, master_port=master_port),
            env={**os.environ, **(env or {})},
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
    finally:
        if log is not None:
            log.close()
