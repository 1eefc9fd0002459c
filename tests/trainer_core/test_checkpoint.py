"""Per-run checkpoints: exact resume, keep_last, half-written ones ignored, SIGKILL mid-write."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from contracts.run_config import OptimSettings, SchedulerSettings
from trainer_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_core.optim import MultiRunOptimizer, lr_factor

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
OPTIM = OptimSettings(lr=0.05, betas=(0.8, 0.95), weight_decay=0.1, max_grad_norm=0.7)
SCHED = SchedulerSettings(kind="cosine", warmup_steps=2, min_lr_ratio=0.1)
MAX_STEPS = 8


def _new_params() -> dict[str, nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {
        "layer.lora_A": nn.Parameter(torch.randn(4, 6, generator=gen)),
        "layer.lora_B": nn.Parameter(torch.zeros(5, 4)),
    }


def _train(params: dict[str, nn.Parameter], opt: MultiRunOptimizer, steps: range) -> None:
    """Two micro-batches per step; data derived from the step number alone."""
    for step in steps:
        for mb in range(2):
            gen = torch.Generator().manual_seed(1000 * step + mb)
            x = torch.randn(3, 6, generator=gen)
            target = torch.randn(3, 5, generator=gen)
            y = x @ params["layer.lora_A"].T @ params["layer.lora_B"].T + x[:, :5]
            ((y - target) ** 2).sum().backward()
            opt.add_loss_tokens(0, 3)
        assert not opt.step([0])[0].nonfinite


def _fresh() -> tuple[dict[str, nn.Parameter], MultiRunOptimizer]:
    params = _new_params()
    opt = MultiRunOptimizer(n_slots=1)
    opt.create(0, list(params.values()), optim=OPTIM, scheduler=SCHED, max_steps=MAX_STEPS)
    return params, opt


def test_round_trip_resumes_bit_identically(tmp_path):
    params, opt = _fresh()
    _train(params, opt, range(0, 3))
    path = save_checkpoint(
        tmp_path,
        3,
        adapter={k: p.detach() for k, p in params.items()},
        optimizer_state=opt.state_dict(0),
        progress={"step": 3, "total_samples": 24, "total_tokens": 300},
        extra={"rng": torch.tensor([1, 2, 3])},
        keep_last=2,
    )
    _train(params, opt, range(3, 7))  # never stopped
    uninterrupted = {k: p.detach().clone() for k, p in params.items()}

    assert latest_checkpoint(tmp_path) == path
    ckpt = load_checkpoint(path)
    assert ckpt.step == 3 and ckpt.progress == {"step": 3, "total_samples": 24, "total_tokens": 300}
    assert torch.equal(ckpt.extra["rng"], torch.tensor([1, 2, 3]))
    resumed, opt2 = _fresh()
    with torch.no_grad():
        for k, p in resumed.items():
            p.copy_(ckpt.adapter[k])
    opt2.load_state_dict(0, ckpt.optimizer_state)
    assert opt2.current_lr(0) == OPTIM.lr * lr_factor(3, scheduler=SCHED, max_steps=MAX_STEPS)
    _train(resumed, opt2, range(3, 7))
    for k in uninterrupted:
        assert torch.equal(resumed[k].detach(), uninterrupted[k]), k
    assert opt2.state_dict(0)["scheduler"] == opt.state_dict(0)["scheduler"]


def _save(root: Path, step: int, keep_last: int = 3, size: int = 4) -> Path:
    return save_checkpoint(
        root,
        step,
        adapter={"w": torch.full((size,), float(step))},
        optimizer_state={"step": torch.tensor(step)},
        progress={"step": step},
        extra={"step": step},
        keep_last=keep_last,
    )


def test_keep_last_prunes_oldest_and_keeps_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_5"
    _save(tmp_path, 6, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_6"]
    # Saving an existing step replaces it.
    save_checkpoint(tmp_path, 6, adapter={"w": torch.ones(2)}, optimizer_state={}, progress={}, keep_last=1)
    assert torch.equal(load_checkpoint(tmp_path / "step_6").adapter["w"], torch.ones(2))
    assert latest_checkpoint(tmp_path / "missing") is None


def test_a_save_of_a_lower_step_is_the_newest_state_and_discards_the_later_ones(tmp_path):
    # A Tinker run loads its step-2 state at step 4 (load_weights), then trains on to step 3: what
    # a restore picks must be that step 3, not the step 4 of the history it left.
    for step in range(1, 5):
        save_checkpoint(
            tmp_path,
            step,
            adapter={"w": torch.full((2,), float(step))},
            optimizer_state={},
            progress={},
            keep_last=3,
        )
    save_checkpoint(
        tmp_path, 3, adapter={"w": torch.full((2,), 30.0)}, optimizer_state={}, progress={}, keep_last=3
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    newest = latest_checkpoint(tmp_path)
    assert newest == tmp_path / "step_3"
    assert torch.equal(load_checkpoint(newest).adapter["w"], torch.full((2,), 30.0))
    # The same with keep_last=1 (the named states of the Tinker API): the new save is the one kept.
    save_checkpoint(tmp_path, 1, adapter={"w": torch.zeros(2)}, optimizer_state={}, progress={}, keep_last=1)
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_half_written_checkpoints_are_never_picked(tmp_path):
    _save(tmp_path, 5)
    # A rename that happened without its STABLE marker, and a temporary directory of a crash.
    (tmp_path / "step_9").mkdir()
    (tmp_path / "step_9" / "adapter.safetensors").write_bytes(b"\0" * 10)
    (tmp_path / ".tmp_step_10_abc").mkdir()
    (tmp_path / ".tmp_step_10_abc" / "progress.json").write_text("{")
    (tmp_path / "step_x").mkdir()  # not ours at all
    assert latest_checkpoint(tmp_path) == tmp_path / "step_5"
    with pytest.raises(FileNotFoundError, match="not a stable checkpoint"):
        load_checkpoint(tmp_path / "step_9")
    # The next save cleans the leftovers of crashed saves.
    _save(tmp_path, 6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5", "step_6", "step_x"]


_CHILD = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from trainer_core.checkpoint import save_checkpoint

    root, pause_at, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    def save(step, announce=False):
        adapter = {f"t{i}": torch.full((size,), float(step)) for i in range(4)}
        if announce:
            print("started 2", flush=True)
        save_checkpoint(root, step, adapter=adapter, optimizer_state={"step": torch.tensor(step)},
                        progress={"step": step}, extra={"step": step}, keep_last=1)

    save(1)
    if pause_at > 0:
        # Freeze the writer just before its pause_at-th fsync of the second save: a
        # deterministic point in the middle of the protocol.
        real_fsync, calls = os.fsync, [0]
        def fsync(fd):
            calls[0] += 1
            if calls[0] == pause_at:
                print("paused", flush=True)
                time.sleep(600)
            real_fsync(fd)
        os.fsync = fsync
    save(2, announce=True)
    print("saved 2", flush=True)
    time.sleep(600)
    """
)


def _kill_mid_write(root: Path, pause_at: int, size: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), str(pause_at), str(size)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        wanted = "paused" if pause_at > 0 else "started 2"
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if lines[-1] == wanted:
                break
        assert lines and lines[-1] == wanted, lines
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        return lines[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _assert_loadable(root: Path, allowed_steps: set[int]) -> int:
    path = latest_checkpoint(root)
    assert path is not None
    ckpt = load_checkpoint(path)
    assert ckpt.step in allowed_steps
    assert all(torch.all(t == float(ckpt.step)) for t in ckpt.adapter.values())
    assert int(ckpt.optimizer_state["step"]) == ckpt.step and ckpt.extra == {"step": ckpt.step}
    return ckpt.step


# fsync calls of one save: 1 adapter, 2 optimizer, 3 progress, 4 extra, 5 temp dir, 6 root after
# the rename, 7 STABLE's temp file, 8 the step dir after STABLE's rename.
@pytest.mark.slow
@pytest.mark.parametrize("pause_at", [1, 5, 6, 7])
def test_sigkill_at_each_point_of_the_protocol_leaves_the_previous_checkpoint(tmp_path, pause_at):
    _kill_mid_write(tmp_path, pause_at, size=1024)
    assert _assert_loadable(tmp_path, {1}) == 1
    # ...and the run goes on: the next save works over the debris.
    _save(tmp_path, 2, keep_last=1)
    assert _assert_loadable(tmp_path, {2}) == 2


@pytest.mark.slow
def test_sigkill_while_writing_a_large_checkpoint(tmp_path):
    # 4 x 4M floats = 64 MB per checkpoint: the kill lands while the second one is being written
    # (if the writer were faster than the kill, step 2 would be complete, which is also fine).
    _kill_mid_write(tmp_path, pause_at=0, size=4 * 1024 * 1024)
    _assert_loadable(tmp_path, {1, 2})
