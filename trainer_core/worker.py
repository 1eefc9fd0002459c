"""The worker pool: `torchrun -m trainer_core.worker --url URL --token TOKEN ...`.

Reads top to bottom: init → loop → cleanup. Every rank holds the same frozen base model
with one LoRA slot per concurrent run. Each iteration:

1. the master syncs run state from the service; all ranks run the deletion/creation hooks
   (reset the slot, create the run's optimizer and scheduler, load its checkpoint);
2. the master claims rollout batches and feeds the packer; when enough tokens are buffered
   it packs and scatters each rank its micro-batches;
3. every rank runs forward/backward on its micro-batches (the loss is a per-run sum);
   LoRA gradients and per-run token counts are all-reduced (sums);
4. each run whose step completed is normalised by its own loss tokens, clipped, stepped;
   the master exports its adapter, uploads it, posts metrics, acknowledges the batches it
   used, checkpoints every `ckpt.interval` steps; a run at `max_steps` is completed by the
   service, a run with non-finite loss or gradients is evicted and the others go on.

Only the master talks to the service; ranks talk through torch.distributed.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from contracts.progress import Progress
from contracts.run_config import DEFAULT_BASE_MODEL, DEFAULT_TARGET_MODULES, RunConfig
from contracts.wire import TrainingBatch
from trainer_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer_core.export import export_peft_adapter
from trainer_core.ledger import BatchLedger
from trainer_core.lora import apply_multi_lora
from trainer_core.loss import rl_loss
from trainer_core.modeling import forward_packed
from trainer_core.models.registry import load_base_model
from trainer_core.optim import MultiRunOptimizer
from trainer_core.packing import InvalidSampleError, MicroBatch, Packer
from trainer_core.runs import MultiRunManager, RunRecord
from trainer_core.service_client import PoolServiceClient, ServiceError

log = logging.getLogger("loraloom.worker")

CLAIM_AHEAD_PACKS = 4
"""Claim more rollout batches only while fewer than this many packs' worth of tokens are buffered."""

# Per-slot statistics all-reduced after every pack, in this column order.
STAT_COLUMNS = ("loss_sum", "loss_tokens", "entropy_sum", "mismatch_kl_sum", "masked_tokens", "nonfinite")


@dataclass
class WorkerArgs:
    url: str
    token: str
    base_model: str = DEFAULT_BASE_MODEL
    max_rank: int = 16
    slots: int = 4
    """Concurrent runs (LoRA slots) this pool trains."""
    seq_len: int = 1024
    """Tokens per packed micro-batch; also the longest sample the pool accepts."""
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    checkpoint_dir: Path = Path("./.loraloom/data/runs")
    """Per-run checkpoints go to checkpoint_dir/<run_id>/checkpoints/step_N."""
    model_cache_dir: Path = Path("./.loraloom/models")
    poll_interval_s: float = 0.2
    pack_timeout_s: float = 2.0
    max_claim: int = 64
    pad_to_multiple_of: int = 8
    device: str = "auto"
    exit_when_idle_s: float | None = None
    """Stop after this long with no active run and nothing buffered (tests, benchmarks)."""


def parse_args(argv: list[str] | None = None) -> WorkerArgs:
    p = argparse.ArgumentParser(prog="trainer_core.worker", description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("LORALOOM_URL", "http://127.0.0.1:8000"))
    p.add_argument("--token", default=os.environ.get("LORALOOM_WORKER_TOKEN"))
    p.add_argument("--base-model", default=DEFAULT_BASE_MODEL, help="hub id, local path, or loraloom-tiny")
    p.add_argument("--max-rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=int(os.environ.get("LORALOOM_MAX_CONCURRENT_RUNS", "4")))
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--target-modules", default=",".join(DEFAULT_TARGET_MODULES))
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("LORALOOM_DATA_DIR", "./.loraloom/data")) / "runs",
    )
    p.add_argument("--model-cache-dir", type=Path, default=Path("./.loraloom/models"))
    p.add_argument("--poll-interval", type=float, default=0.2)
    p.add_argument("--pack-timeout", type=float, default=2.0)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--exit-when-idle", type=float, default=None)
    a = p.parse_args(argv)
    if not a.token:
        p.error("--token or LORALOOM_WORKER_TOKEN is required")
    return WorkerArgs(
        url=a.url,
        token=a.token,
        base_model=a.base_model,
        max_rank=a.max_rank,
        slots=a.slots,
        seq_len=a.seq_len,
        target_modules=tuple(m.strip() for m in a.target_modules.split(",") if m.strip()),
        checkpoint_dir=a.checkpoint_dir,
        model_cache_dir=a.model_cache_dir,
        poll_interval_s=a.poll_interval,
        pack_timeout_s=a.pack_timeout,
        device=a.device,
        exit_when_idle_s=a.exit_when_idle,
    )


class HttpRunSource:
    """RunSource over the service: the runs the service says this pool should train."""

    def __init__(self, client: PoolServiceClient) -> None:
        self.client = client

    def list_runs(self) -> list[RunRecord]:
        records = []
        for run in self.client.state():
            p = run.get("progress") or {}
            progress = Progress(
                step=p.get("step", 0),
                total_tokens=p.get("total_tokens", 0),
                total_samples=p.get("total_samples", 0),
            )
            records.append(RunRecord(run["run_id"], run["config"], slot_hint=run["slot"], progress=progress))
        return records

    def evict(self, run_id: str, reason: str) -> None:
        self.client.evict(run_id, reason)

    def report_invalid_config(self, run_id: str, message: str) -> None:
        self.client.evict(run_id, f"invalid config: {message}")

    def clear_invalid_config(self, run_id: str) -> None:
        return None


@dataclass
class _StepAccumulator:
    """A run's metrics summed over the packs of its current step (master only)."""

    started: float = field(default_factory=time.monotonic)
    loss_sum: float = 0.0
    loss_tokens: float = 0.0
    entropy_sum: float = 0.0
    mismatch_kl_sum: float = 0.0
    masked_tokens: float = 0.0
    tokens: int = 0
    samples: int = 0


class PoolTrainer:
    def __init__(
        self,
        args: WorkerArgs,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        client: PoolServiceClient | None = None,
    ) -> None:
        """`client`: the master's connection to the service (made from args when None; a benchmark
        passes an in-memory stand-in with the same methods to measure the service's overhead)."""
        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.is_master = rank == 0
        self.device = device
        self.stop_requested = False

        # Every rank builds the same base model; the master builds the cache first.
        if self.is_master:
            self.model = load_base_model(args.base_model, cache_dir=args.model_cache_dir)
        _barrier()
        if not self.is_master:
            self.model = load_base_model(args.base_model, cache_dir=args.model_cache_dir)
        self.model.to(device)
        self.vocab_size = int(self.model.config.vocab_size)
        self.lora = apply_multi_lora(self.model, args.target_modules, args.slots, args.max_rank)
        self.model.train()
        self.optimizer = MultiRunOptimizer(args.slots)

        self.client: PoolServiceClient | None = None
        if self.is_master:
            self.client = client or PoolServiceClient(args.url, args.token)
            reg = self.client.register(
                base_model=args.base_model,
                vocab_size=self.vocab_size,
                max_rank=args.max_rank,
                target_modules=list(args.target_modules),
                slots=args.slots,
                world_size=world_size,
                max_seq_len=args.seq_len,
            )
            log.info("registered pool %s (%d slots, world size %d)", reg.pool_id, args.slots, world_size)
            self._heartbeat = _Heartbeat(self.client, reg.heartbeat_interval_s)
            self._heartbeat.start()
            self.packer = Packer(
                n_slots=args.slots,
                seq_len=args.seq_len,
                dp_world_size=world_size,
                pad_to_multiple_of=args.pad_to_multiple_of,
                timeout_s=args.pack_timeout_s,
                vocab_size=self.vocab_size,
            )
            self.ledger = BatchLedger()
            self._idle_since = time.monotonic()
            self.accumulators: dict[int, _StepAccumulator] = {}
        # Non-master ranks never read the source: they follow the master in synchronize_state().
        source = HttpRunSource(self.client) if self.client else None
        self.runs = MultiRunManager(source, args.slots, rank=rank, world_size=world_size)
        self.runs.creation_hooks.append(self._on_run_created)
        self.runs.deletion_hooks.append(self._on_run_deleted)

    # -- run lifecycle hooks (every rank, in the same order) --------------------------------------

    def _on_run_created(self, idx: int, run_id: str) -> None:
        config: RunConfig = self.runs.config[idx]
        self.lora.configure_slot(
            idx, rank=config.lora.rank, alpha=config.lora.alpha, dropout=config.lora.dropout
        )
        # Seeded by the run's config alone: every rank gets the same initial adapter, and a run's
        # adapter does not depend on which slot it got or which runs came before it (isolation).
        self.lora.reset_slot(idx, seed=config.seed)
        self.optimizer.create(
            idx,
            self.lora.slot_parameters(idx),
            optim=config.optim,
            scheduler=config.scheduler,
            max_steps=config.max_steps,
        )
        progress = Progress(step=0, total_tokens=0, total_samples=0)
        ckpt_path = latest_checkpoint(self._checkpoint_root(run_id))
        if ckpt_path is not None:
            ckpt = load_checkpoint(ckpt_path)
            self.lora.load_slot_state_dict(idx, ckpt.adapter)
            self.optimizer.load_state_dict(idx, ckpt.optimizer_state)
            progress = Progress(**ckpt.progress)
        log.info("rank %d: run %s in slot %d from step %d", self.rank, run_id, idx, progress.step)
        if self.is_master:
            assert self.client is not None
            # Exactly-once: everything the service handed out after this checkpoint comes back.
            self.client.restart_run(
                run_id,
                checkpoint_step=progress.step,
                total_samples=progress.total_samples,
                total_tokens=progress.total_tokens,
            )
            self.packer.add_run(idx, batch_size=config.batch_size)
            self.packer.set_progress(
                idx,
                step=progress.step,
                total_tokens=progress.total_tokens,
                total_samples=progress.total_samples,
            )
            self.ledger.reset_slot(idx, next_sample=progress.total_samples)
            self.accumulators[idx] = _StepAccumulator()

    def _on_run_deleted(self, idx: int, run_id: str) -> None:
        self.optimizer.remove(idx)
        self.lora.reset_slot(idx)
        if self.is_master:
            self.packer.remove_run(idx)
            self.ledger.reset_slot(idx, next_sample=0)
            self.accumulators.pop(idx, None)
        log.info("rank %d: run %s left slot %d", self.rank, run_id, idx)

    def _checkpoint_root(self, run_id: str) -> Path:
        return self.args.checkpoint_dir / run_id / "checkpoints"

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            if self.is_master:
                self.runs.discover_runs()
            self.runs.synchronize_state()

            # The master decides; every rank follows the same plan, so collectives stay matched.
            plan = self._plan_iteration() if self.is_master else None
            plan, my_micro_batches = _distribute(plan, self.world_size, self.rank)
            if plan["kind"] == "stop":
                break
            if plan["kind"] == "idle":
                time.sleep(self.args.poll_interval_s)
                continue
            self._train_on(my_micro_batches, plan)

    def _should_exit(self) -> bool:
        limit = self.args.exit_when_idle_s
        return (
            limit is not None
            and not self.runs.used_idxs
            and self.packer.buffered_tokens() == 0
            and time.monotonic() - self._idle_since > limit
        )

    def _plan_iteration(self) -> dict:
        """Master: claim batches, pack if ready. Returns the plan every rank follows."""
        assert self.client is not None
        if self.stop_requested or self._heartbeat.lost:
            return {"kind": "stop"}
        # Claim only while the buffer is short of a few packs: what sits in memory is leased, and a
        # flood of batches from one run must stay in the service's queue, not in this process.
        if (
            self.runs.used_idxs
            and self.packer.buffered_tokens() < CLAIM_AHEAD_PACKS * self.packer.token_budget
        ):
            for claimed in self.client.claim(self.args.max_claim):
                self._feed_packer(claimed)
        if not self.packer.is_ready():
            return {"kind": "stop"} if self._should_exit() else {"kind": "idle"}
        result = self.packer.pack()
        if result is None:
            return {"kind": "idle"}
        self._idle_since = time.monotonic()
        completing: dict[int, int] = {}
        for slot, stats in result.runs.items():
            self.ledger.consumed(slot, [ref.batch_id for ref in stats.consumed])
            acc = self.accumulators.setdefault(slot, _StepAccumulator())
            acc.tokens += stats.tokens
            acc.samples += stats.samples
            if stats.step_completed:
                completing[slot] = stats.step
        return {"kind": "train", "micro_batches": result.micro_batches, "completing": completing}

    def _feed_packer(self, claimed: dict) -> None:
        run_id = claimed["run_id"]
        slot = self.runs.id_2_idx.get(run_id)
        if slot is None:  # the run left the pool since the claim; its lease will expire
            return
        batch = _decode_batch(claimed["payload"])
        fresh = self.ledger.add(
            slot,
            batch_id=claimed["id"],
            sample_offset=claimed["sample_offset"],
            num_samples=claimed["num_samples"],
        )
        if fresh == 0:
            return
        try:
            self.packer.add_batch(slot, batch, batch_id=claimed["id"], skip=claimed["num_samples"] - fresh)
        except InvalidSampleError as exc:
            self.runs.evict_run(slot, f"trainer rejected batch {claimed['id']}: {exc}")

    def _backward(self, mb: MicroBatch, slot_settings: dict) -> dict:
        with self.lora.segments(mb.slot_token_counts):
            logits = forward_packed(self.model, mb)
        result = rl_loss(logits, mb, slot_settings=slot_settings, n_slots=self.args.slots)
        result.total.backward()
        return result.per_slot

    def _backward_isolated(self, mb: MicroBatch, slot_settings: dict) -> dict:
        """Forward/backward one micro-batch; a run whose gradients blow up cannot poison the others.

        The loss already drops a run whose loss is non-finite. But a finite loss can still overflow
        in the backward pass, and the shared base-model backward then spreads Inf/NaN to every run
        in the row (masked attention gives 0 × Inf). So: keep the gradients from before this
        micro-batch; if any present run's gradients come out non-finite, go back to them and redo
        the row once per run, keeping each run's result only if it is finite. The failing run is
        reported non-finite (and evicted); the others get exactly their own gradients. Costs one
        clone of the present runs' LoRA gradients per micro-batch, and extra passes only on failure.
        """
        present = [slot for slot, n in enumerate(mb.slot_token_counts.tolist()) if n > 0]
        params = [p for slot in present if slot in slot_settings for p in self.lora.slot_parameters(slot)]
        before = [None if p.grad is None else p.grad.clone() for p in params]
        per_slot = self._backward(mb, slot_settings)
        if _grads_finite(params):
            return per_slot
        _restore_grads(params, before)
        merged: dict = {}
        for slot in present:
            if slot not in slot_settings:
                continue
            only = dataclasses.replace(mb, loss_mask=mb.loss_mask & (mb.token_slots == slot))
            kept = [None if p.grad is None else p.grad.clone() for p in params]
            stats = self._backward(only, slot_settings).get(slot)
            if stats is None:
                continue
            if not _grads_finite(params):
                _restore_grads(params, kept)
                stats = dataclasses.replace(stats, nonfinite=True)
            merged[slot] = stats
        return merged

    def _train_on(self, micro_batches: list, plan: dict) -> None:
        n_slots = self.args.slots
        stats = torch.zeros(n_slots, len(STAT_COLUMNS), dtype=torch.float64)
        slot_settings = {idx: self.runs.config[idx].loss for idx in self.runs.used_idxs}
        for mb in micro_batches:
            if mb.is_filler:
                continue  # fillers only keep ranks in step; they carry no loss
            mb = _to_device(mb, self.device)
            for slot, s in self._backward_isolated(mb, slot_settings).items():
                stats[slot] += torch.tensor(
                    [
                        s.loss_sum,
                        s.loss_tokens,
                        s.entropy_sum,
                        s.mismatch_kl_sum,
                        s.masked_tokens,
                        float(s.nonfinite),
                    ],
                    dtype=torch.float64,
                )
        used = sorted(self.runs.used_idxs)
        _all_reduce_sum(stats)
        _all_reduce_grads([p for idx in used for p in self.lora.slot_parameters(idx)])
        for idx in used:
            self.optimizer.add_loss_tokens(idx, int(stats[idx, 1].item()))

        completing: dict[int, int] = plan["completing"]
        nonfinite = {idx for idx in used if stats[idx, 5].item() > 0}
        to_step = [idx for idx in completing if idx not in nonfinite]
        step_stats = self.optimizer.step(to_step) if to_step else {}
        nonfinite |= {idx for idx, s in step_stats.items() if s.nonfinite}
        if self.rank != 0:
            # The master keeps the running sum of a partial step; the others restart from zero so
            # that the next all-reduce adds only their new contributions.
            for idx in used:
                if idx not in step_stats:
                    for p in self.lora.slot_parameters(idx):
                        p.grad = None
        if self.is_master:
            self._publish(completing, step_stats, stats, nonfinite)

    def _publish(
        self, completing: dict[int, int], step_stats: dict, stats: torch.Tensor, nonfinite: set[int]
    ) -> None:
        """Master: for every completed step, push adapter, metrics, acks, checkpoint; evict broken runs."""
        assert self.client is not None
        for idx in range(self.args.slots):
            acc = self.accumulators.get(idx)
            if acc is None or idx not in self.runs.used_idxs:
                continue
            acc.loss_sum += stats[idx, 0].item()
            acc.loss_tokens += stats[idx, 1].item()
            acc.entropy_sum += stats[idx, 2].item()
            acc.mismatch_kl_sum += stats[idx, 3].item()
            acc.masked_tokens += stats[idx, 4].item()
        for idx in sorted(nonfinite):
            if idx in self.runs.used_idxs:
                self.runs.evict_run(idx, "non-finite loss or gradients (NaN/Inf) in this run's step")
        for idx, step in sorted(completing.items()):
            if idx in nonfinite or idx not in step_stats:
                continue
            run_id = self.runs.idx_2_id[idx]
            config: RunConfig = self.runs.config[idx]
            progress = self.packer.progress(idx)
            acc = self.accumulators.pop(idx)
            self.accumulators[idx] = _StepAccumulator()
            with tempfile.TemporaryDirectory(prefix=f"{run_id}-step{step}-") as tmp:
                adapter_dir = export_peft_adapter(
                    self.lora, idx, Path(tmp) / "adapter", base_model_name_or_path=self.args.base_model
                )
                self.client.upload_adapter(run_id, step, adapter_dir)
            tokens = max(acc.loss_tokens, 1.0)
            metrics = {
                "loss": acc.loss_sum / tokens,
                "entropy": acc.entropy_sum / tokens,
                "mismatch_kl": acc.mismatch_kl_sum / tokens,
                "masked_fraction": acc.masked_tokens / max(acc.loss_tokens + acc.masked_tokens, 1.0),
                "grad_norm": float(step_stats[idx].grad_norm),
                "lr": float(step_stats[idx].lr),
                "tokens": acc.tokens,
                "samples": acc.samples,
                "step_time_s": time.monotonic() - acc.started,
            }
            if step % config.ckpt.interval == 0:
                self._checkpoint(idx, run_id, step, progress, config)
            self.client.report_step(
                run_id,
                step=step,
                total_tokens=progress.total_tokens,
                total_samples=progress.total_samples,
                metrics=metrics,
            )
            self.client.ack(self.ledger.step_completed(idx, step))
            log.info("run %s step %d: loss %.4f, %d samples", run_id, step, metrics["loss"], acc.samples)

    def _checkpoint(self, idx: int, run_id: str, step: int, progress, config: RunConfig) -> None:
        assert self.client is not None
        save_checkpoint(
            self._checkpoint_root(run_id),
            step,
            adapter=self.lora.slot_state_dict(idx),
            optimizer_state=self.optimizer.state_dict(idx),
            progress={
                "step": step,
                "total_tokens": progress.total_tokens,
                "total_samples": progress.total_samples,
            },
            keep_last=config.ckpt.keep_last,
        )
        self.client.report_checkpoint(run_id, step=step, total_samples=progress.total_samples)

    def close(self) -> None:
        if self.is_master and self.client is not None:
            self._heartbeat.stop()
            self.client.close()


class _Heartbeat(threading.Thread):
    """Keeps the pool alive (and its leases extended) even while a long step runs."""

    def __init__(self, client: PoolServiceClient, interval_s: float) -> None:
        super().__init__(name="pool-heartbeat", daemon=True)
        self._client = client
        self._interval = interval_s
        self._stopped = threading.Event()
        self.lost = False
        """Set when the service no longer knows this pool."""

    def run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._client.heartbeat()
            except ServiceError as exc:
                if exc.code in ("pool_dead", "pool_stopped"):
                    # The service gave our leases away (or another pool replaced us): training on
                    # would duplicate work. Stop; a restarted pool resumes from checkpoints.
                    log.error("pool no longer registered (%s); stopping", exc.code)
                    self.lost = True
                    return
                log.warning("heartbeat failed: %s", exc)
            except Exception as exc:  # transient: the next beat retries
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stopped.set()


# -- helpers ----------------------------------------------------------------------------------------


def _decode_batch(payload) -> TrainingBatch:
    return msgspec.convert(payload, TrainingBatch)


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    moved = {
        f.name: getattr(mb, f.name).to(device)
        for f in dataclasses.fields(mb)
        if isinstance(getattr(mb, f.name), torch.Tensor)
    }
    return dataclasses.replace(mb, **moved)


def _grads_finite(params: list[torch.nn.Parameter]) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)


def _restore_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _distribute(plan: dict | None, world_size: int, rank: int) -> tuple[dict, list]:
    """Master → all: the plan (without micro-batches) and each rank's own micro-batches."""
    if world_size == 1:
        assert plan is not None
        return plan, plan.get("micro_batches", [[]])[0] if plan["kind"] == "train" else []
    header = [None]
    if rank == 0:
        assert plan is not None
        header = [{k: v for k, v in plan.items() if k != "micro_batches"}]
    dist.broadcast_object_list(header, src=0)
    mine = [None]
    if header[0]["kind"] == "train":
        per_rank = plan["micro_batches"] if rank == 0 else None
        dist.scatter_object_list(mine, per_rank, src=0)
    return header[0], mine[0] or []


def _all_reduce_sum(tensor: torch.Tensor) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def _all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the LoRA gradients of the active slots across ranks, in one flat buffer."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1) or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


def _pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _die_with_parent() -> None:
    """Linux: a rank gets SIGKILL when its torchrun parent dies, so killing the launcher kills the pool.

    torchrun starts ranks in their own sessions; without this an orphaned rank would keep
    training on leases the service already handed to a new pool.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str] | None = None) -> None:
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the log
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(args.device, local_rank)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)  # every rank must build identical LoRA initialisations
    # Split the cores between ranks unless the launcher said otherwise (OMP_NUM_THREADS).
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else max(1, (os.cpu_count() or 1) // world_size))
    trainer = PoolTrainer(args, rank=rank, world_size=world_size, device=device)

    def _request_stop(signum, _frame):
        trainer.stop_requested = True

    signal.signal(signal.SIGTERM, _request_stop)
    try:
        trainer.run()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
