"""Two real processes in a gloo group: synchronize_state() makes both ranks agree, and every
rank gets the same releases and admissions, in the documented order (issue 3 acceptance)."""

import json
import os
import shutil
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch
import torch.distributed as dist

from contracts.run_config import RunConfig
from tests.trainer_core.gloo_ranks import spawn_ranks
from trainer_core.directory_source import DirectoryRunSource
from trainer_core.dist import World, barrier
from trainer_core.runs import MultiRunManager, SlotChanges

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
        "run_ids": {str(k): v for k, v in sorted(m.run_ids.items())},
        "slots": dict(sorted(m.slots.items())),
        "config": {str(k): c.model_dump(mode="json") for k, c in sorted(m.config.items())},
        "free_slots": m.free_slots,
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
    log: list[list[Any]] = []

    def validate(config: RunConfig) -> list[str]:
        log.append(["validation", config.batch_size])
        return []

    def apply(changes: SlotChanges) -> None:
        # What the trainer does with the changes: release, then admit, in the order given. Both
        # ranks do it in lockstep, so collectives inside work.
        for slot, run_id in changes.released:
            log.append(["release", slot, run_id])
        for slot, run_id, _ in changes.admitted:
            log.append(["admit", slot, run_id])
            barrier(world)

    # Only the master talks to the source, as with the service.
    world = World(rank=rank, world_size=WORLD_SIZE)
    m = MultiRunManager(DirectoryRunSource(root) if rank == 0 else None, 2, world=world, check=validate)

    snapshots = []
    log.append(["round", 1])
    if rank == 0:
        m.discover_runs()
    apply(m.synchronize_state())
    snapshots.append(_snapshot(m))

    log.append(["round", 2])
    if rank == 0:
        shutil.rmtree(root / RUN_A)
        _make_run(root, RUN_C, {"batch_size": 3, "lora": {"rank": 4}})
        m.discover_runs()
    apply(m.synchronize_state())
    snapshots.append(_snapshot(m))

    (out_dir / f"rank{rank}.json").write_text(json.dumps({"snapshots": snapshots, "log": log}))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_gloo_ranks_agree_and_change_slots_in_order(tmp_path: Path) -> None:
    root, out_dir = tmp_path / "outputs", tmp_path / "out"
    out_dir.mkdir()
    _make_run(root, RUN_A, {"batch_size": 1})
    _make_run(root, RUN_B, {"batch_size": 2, "optim": {"lr": 0.001}})

    results = spawn_ranks(_worker, (root,), out_dir, world_size=WORLD_SIZE, timeout=90)
    first, second = (r["snapshots"] for r in results)
    assert first == second

    round1, round2 = first
    assert round1["run_ids"] == {"0": RUN_A, "1": RUN_B}
    assert round1["config"]["1"] == RunConfig(batch_size=2, optim={"lr": 0.001}).model_dump(mode="json")
    assert round2["run_ids"] == {"0": RUN_C, "1": RUN_B}
    assert round2["slots"] == {RUN_B: 1, RUN_C: 0}
    assert round2["config"]["0"]["batch_size"] == 3 and round2["config"]["0"]["lora"]["rank"] == 4
    assert round2["free_slots"] == []

    master_log, worker_log = (r["log"] for r in results)
    assert master_log == [
        ["round", 1],
        ["validation", 1],
        ["validation", 2],
        ["admit", 0, RUN_A],
        ["admit", 1, RUN_B],
        ["round", 2],
        ["validation", 3],
        ["release", 0, RUN_A],
        ["admit", 0, RUN_C],
    ]
    # Validation is the master's alone; the other rank releases before it admits, as the master does.
    assert worker_log == [
        ["round", 1],
        ["admit", 0, RUN_A],
        ["admit", 1, RUN_B],
        ["round", 2],
        ["release", 0, RUN_A],
        ["admit", 0, RUN_C],
    ]
