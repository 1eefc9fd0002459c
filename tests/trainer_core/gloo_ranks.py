"""Real processes in a gloo group for the trainer tests: spawn one per rank, wait, and read what each
wrote (test_runs_distributed.py, the manual-work failure tests through manual_ranks.py)."""

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def spawn_ranks(
    target: Callable[..., None], args: tuple[Any, ...], out_dir: Path, *, world_size: int, timeout: float
) -> list[dict[str, Any]]:
    """Run `target(rank, init_method, *args, out_dir)` (a module-level function: the ranks are
    spawned) on `world_size` processes; each writes `rank{r}.json` (its report) or `rank{r}.err`
    (its traceback) into `out_dir`. The reports in rank order; fails with a rank's traceback if one
    raised or hung past `timeout` seconds."""
    ctx = mp.get_context("spawn")
    # The ranks meet in a file, not on a port: a port picked free here and bound seconds later by
    # rank 0 (once torch has imported) was, at times, taken meanwhile by another test process. gloo's
    # own connections listen on ports the kernel gives them. A new file each time (the file store
    # needs one that no earlier group used).
    init_method = f"file://{tempfile.mkdtemp(dir=out_dir)}/rendezvous"
    procs = [ctx.Process(target=target, args=(r, init_method, *args, out_dir)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for r, p in enumerate(procs):
        err_file = out_dir / f"rank{r}.err"
        err = err_file.read_text() if err_file.exists() else "(no traceback: hung or killed)"
        assert p.exitcode == 0, f"rank {r} exited with {p.exitcode}:\n{err}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
