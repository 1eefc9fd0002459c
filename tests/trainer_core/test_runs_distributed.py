"""Two real processes in a gloo group: synchronize_state() makes both ranks agree, and
each rank runs the hooks in the documented order (issue 3 acceptance)."""

import dataclasses
import json
import os
import shutil
import socket
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from contracts.run_config import RunConfig
from trainer_core.runs import DirectoryRunSource, MultiRunManager

RUN_A = "run_aaaaaaaaaaaa"
RUN_B = "run_bbbbbbbbbbbb"
RUN_C = "run_cccccccccccc"
WORLD_SIZE = 2


def _make_run(root: Path, run_id: str, config: dict[str, Any]) -> None:
    control = root / run_id / "control"
    control.mkdir(parents=True)
    (control / "orch.toml").write_text(tomli_w.dumps(config))


def _snapshot(m: MultiRunManager) -> dict[str, Any]:
    return {
        "idx_2_id": {str(k): v for k, v in sorted(m.idx_2_id.items())},
        "id_2_idx": dict(sorted(m.id_2_idx.items())),
        "config": {str(k): c.model_dump(mode="json") for k, c in sorted(m.config.items())},
        "progress": {str(k): dataclasses.asdict(p) for k, p in sorted(m.progress.items())},
        "ready_to_update_idxs": m.ready_to_update_idxs,
        "unused_idxs": m.unused_idxs,
    }


def _worker(rank: int, init_method: str, root: Path, out_dir: Path) -> None:
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # stay on loopback whatever the hostname resolves to
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=30)
        )
        try:
            _run_rounds(rank, root, out_dir)
        finally:
            dist.destroy_process_group()
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _run_rounds(rank: int, root: Path, out_dir: Path) -> None:
    # Only the master talks to the source, as with the service.
    m = MultiRunManager(DirectoryRunSource(root) if rank == 0 else None, 2, rank=rank, world_size=WORLD_SIZE)
    log: list[list[Any]] = []

    def validate(config: RunConfig) -> tuple[bool, str]:
        log.append(["validation", config.batch_size])
        return True, ""

    def create(idx: int, run_id: str) -> None:
        log.append(["creation", idx, run_id])
        dist.barrier()  # hooks run in lockstep on every rank, so collectives inside them work

    m.forgotten_hooks.append(lambda i, r: log.append(["forgotten", i, r]))
    m.config_validation_hooks.append(validate)
    m.discovered_hooks.append(lambda i, r, c: log.append(["discovered", i, r]))
    m.deletion_hooks.append(lambda i, r: log.append(["deletion", i, r]))
    m.creation_hooks.append(create)

    snapshots = []
    log.append(["round", 1])
    if rank == 0:
        m.discover_runs()
    m.synchronize_state()
    snapshots.append(_snapshot(m))

    log.append(["round", 2])
    if rank == 0:
        shutil.rmtree(root / RUN_A)
        _make_run(root, RUN_C, {"batch_size": 3, "lora": {"rank": 4}})
        m.discover_runs()
        # What the packer does on the master between discovery and synchronisation.
        b = m.id_2_idx[RUN_B]
        m.progress[b].step, m.progress[b].total_tokens, m.progress[b].total_samples = 1, 40, 2
        m.ready_to_update[b] = True
    m.synchronize_state()
    snapshots.append(_snapshot(m))

    (out_dir / f"rank{rank}.json").write_text(json.dumps({"snapshots": snapshots, "log": log}))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_gloo_ranks_agree_and_run_hooks_in_order(tmp_path: Path) -> None:
    root, out_dir = tmp_path / "outputs", tmp_path / "out"
    out_dir.mkdir()
    _make_run(root, RUN_A, {"batch_size": 1})
    _make_run(root, RUN_B, {"batch_size": 2, "optim": {"lr": 0.001}})

    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_worker, args=(r, init_method, root, out_dir)) for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    for r, p in enumerate(procs):
        err_file = out_dir / f"rank{r}.err"
        err = err_file.read_text() if err_file.exists() else "(no traceback: hung or killed)"
        assert p.exitcode == 0, f"rank {r} exited with {p.exitcode}:\n{err}"

    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    first, second = (r["snapshots"] for r in results)
    assert first == second

    round1, round2 = first
    assert round1["idx_2_id"] == {"0": RUN_A, "1": RUN_B}
    assert round1["config"]["1"] == RunConfig(batch_size=2, optim={"lr": 0.001}).model_dump(mode="json")
    assert round1["ready_to_update_idxs"] == []
    assert round2["idx_2_id"] == {"0": RUN_C, "1": RUN_B}
    assert round2["id_2_idx"] == {RUN_B: 1, RUN_C: 0}
    assert round2["config"]["0"]["batch_size"] == 3 and round2["config"]["0"]["lora"]["rank"] == 4
    assert round2["progress"] == {
        "0": {"step": 0, "total_tokens": 0, "total_samples": 0},
        "1": {"step": 1, "total_tokens": 40, "total_samples": 2},
    }
    assert round2["ready_to_update_idxs"] == [1]
    assert round2["unused_idxs"] == []

    master_log, worker_log = (r["log"] for r in results)
    assert master_log == [
        ["round", 1],
        ["validation", 1],
        ["validation", 2],
        ["discovered", 0, RUN_A],
        ["discovered", 1, RUN_B],
        ["creation", 0, RUN_A],
        ["creation", 1, RUN_B],
        ["round", 2],
        ["forgotten", 0, RUN_A],
        ["validation", 3],
        ["discovered", 0, RUN_C],
        ["deletion", 0, RUN_A],
        ["creation", 0, RUN_C],
    ]
    # Master-only hooks never run on the other rank; deletion precedes creation there too.
    assert worker_log == [
        ["round", 1],
        ["creation", 0, RUN_A],
        ["creation", 1, RUN_B],
        ["round", 2],
        ["deletion", 0, RUN_A],
        ["creation", 0, RUN_C],
    ]
