"""Pool idle-time share and step latency with small on-policy RL batches: the pack rule of
`Packer.is_ready` (pack once every run with work has its step's worth) against the rule before it
(a full token budget, else the pack timeout), both at the CLI's default pack timeout (2 s) and the
demo's (0.3 s).

Each run's batch for step k is handed out only after the pool reported the run's step k (on-policy:
the orchestrator samples with the newest adapter, and its sampling is taken as instant here, so what
idle time remains is the pool's own). The real `PoolTrainer` loop and model loader, an in-memory
service client (trainer_core.memory_client), a small Llama from config saved to disk.

    .venv/bin/python -m bench.idle
"""

import argparse
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.pool_throughput import build_model, make_payloads, run_config
from contracts.pool_api import ClaimedBatchStruct
from trainer_core.dist import World
from trainer_core.http_source import HttpRunSource
from trainer_core.memory_client import MemoryPoolClient, Timing
from trainer_core.worker import PoolTrainer, WorkerArgs


class OnPolicyClient(MemoryPoolClient):
    """Hands out a run's step-k batch only once the run has finished step k."""

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        self.timing.first_claim = self.timing.first_claim or time.perf_counter()
        ready = [
            b
            for b in self.pending
            if b.rollout_step <= self.runs[b.run_id].step and (run_ids is None or b.run_id in run_ids)
        ][:max_batches]
        taken = {b.id for b in ready}
        self.pending = [b for b in self.pending if b.id not in taken]
        return ready


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=4096, help="a pack's token budget is never reached")
    p.add_argument("--timeouts", default="2.0,0.3", help="pack timeouts to compare (CLI default, demo)")
    return p.parse_args(argv)


def one_pass(
    args: argparse.Namespace, model_dir: Path, work: Path, *, timeout: float, new_rule: bool
) -> tuple[float, float, int]:
    """(seconds from first claim to last step report, idle share, steps)."""
    timing = Timing()
    config = run_config(args) | {"base_model": str(model_dir)}
    client: Any = OnPolicyClient(make_payloads(args), config, timing)
    worker_args = WorkerArgs(
        url="unused",
        token="unused",
        base_model=str(model_dir),
        max_rank=16,
        slots=args.runs,
        seq_len=args.seq_len,
        checkpoint_dir=work / "ckpt",
        pack_timeout_s=timeout,
        poll_interval_s=0.2,  # the CLI default
        exit_when_idle_s=0.3,
    )
    trainer = PoolTrainer(
        worker_args, world=World(), device=torch.device("cpu"), source=HttpRunSource(client)
    )
    assert trainer.master is not None
    trainer.master.packer.pack_on_full_steps = new_rule
    try:
        trainer.run()
    finally:
        trainer.close()
    assert timing.first_claim is not None and timing.last_step is not None
    return timing.last_step - timing.first_claim, trainer.loop_time.idle_share, trainer.loop_time.steps


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="loraloom-bench-idle-"))
    try:
        model_dir = build_model(args, work / "model")
        print(
            f"model: Llama hidden {args.hidden}, {args.layers} layers; {args.runs} runs × {args.steps} steps × "
            f"{args.batch_size} samples of {args.prompt_len}+{args.completion_len} tokens, seq_len {args.seq_len}\n"
        )
        print("| pack timeout | pack rule | seconds | per run-step | pool steps | idle share |")
        print("|---:|---|---:|---:|---:|---:|")
        for timeout in (float(t) for t in args.timeouts.split(",")):
            for new_rule in (False, True):
                label = "full steps, then timeout" if new_rule else "budget or timeout (before)"
                seconds, idle, steps = one_pass(
                    args, model_dir, work / f"{timeout}-{new_rule}", timeout=timeout, new_rule=new_rule
                )
                print(
                    f"| {timeout:g} s | {label} | {seconds:.1f} | {seconds / args.steps:.2f} s | {steps} | "
                    f"{100 * idle:.0f} % |"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
