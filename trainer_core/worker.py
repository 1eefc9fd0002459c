"""The worker pool: `torchrun -m trainer_core.worker --url URL --token TOKEN ...` (or `--runs-dir DIR`).

Reads top to bottom: init → loop → cleanup. Every rank holds the same frozen base model with one
LoRA slot per concurrent run. Each iteration:

1. the master asks its run source (the service, or run directories) which runs to train; every
   rank then releases the slots of the runs that left and admits the new ones, in the same order
   (`admit_slot` restores a run from its checkpoint, `release_slot` forgets everything of it);
2. the master claims rollout batches and feeds the packer; when enough tokens are buffered it packs
   and sends every rank its micro-batches, with the plan of which runs' steps complete;
3. every rank runs `train_step`: forward/backward of its micro-batches (the loss is a per-run sum),
   the all-reduce of LoRA gradients and per-run statistics, and the optimizer step of each run whose
   step completed (normalised by its own loss tokens, clipped, stepped);
4. the master publishes each completed step (adapter, checkpoint, metrics, acknowledgements) and
   evicts runs whose loss or gradients went non-finite; the others go on.

Only the master talks to the run source; ranks talk through torch.distributed (`trainer_core.dist`).
"""

# ruff: noqa: E402 - the rank must follow its launcher before importing torch (see below)
import signal

from trainer_core.parent_death import die_with_parent

if __name__ == "__main__":
    # First thing: a launcher killed during the seconds of torch imports must not orphan this rank.
    die_with_parent()
    # Until `main` installs its stop handlers (the trainer built), SIGTERM and SIGINT end the rank at
    # once, by the signal: a rank importing torch or building the model holds nothing to finish or
    # give back, and it may wait inside a collective (for the master's model) where no Python handler
    # runs. loraloom.torchrun reports that in its one line. SIGINT too, which Python would turn into
    # a KeyboardInterrupt traceback per rank (it reaches the ranks of a torchrun in a terminal); an
    # ignored SIGINT (a background job of a shell) stays ignored.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse
import dataclasses
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Literal, cast

import torch
from pydantic import ValidationError
from torch import nn
from transformers import PreTrainedModel

from contracts.http import ApiError, RetryStopped
from contracts.pool_api import ClaimedBatchStruct, PoolRegister
from contracts.run_config import DEFAULT_BASE_MODEL, DEFAULT_TARGET_MODULES, RunConfig
from contracts.tinker_work import ManualResult, ManualWorkItem
from trainer_core.critic import ValueHeads, uses_critic
from trainer_core.device_errors import is_fatal_device_error
from trainer_core.directory_source import DirectoryRunSource
from trainer_core.dist import (
    World,
    broadcast_from_master,
    destroy_world,
    init_world,
    pick_device,
    scatter_from_master,
)
from trainer_core.external_sampler import ExternalSampler
from trainer_core.http_source import HttpRunSource
from trainer_core.init_from import load_initial_weights, module_shapes
from trainer_core.ledger import RunLedger
from trainer_core.lora import apply_multi_lora
from trainer_core.manual import ManualExecutor, ManualWorkClient
from trainer_core.models.registry import BaseModelError, load_base_model
from trainer_core.optim import MultiRunOptimizer
from trainer_core.packing import MicroBatch, Packer
from trainer_core.pause_point import STARTUP_BEFORE_MODEL, pause_at, pause_before_publish
from trainer_core.publish import Publisher, restore_manual_boundary, restore_slot
from trainer_core.run_files import DeletedRunsSource, RunFiles
from trainer_core.run_left import run_has_left
from trainer_core.runs import MultiRunManager, RunSource, pool_config_problems
from trainer_core.sample_server import load_text_decoder, remove_sampler_weights
from trainer_core.service_client import PoolServiceClient
from trainer_core.settings import (
    SETTING_ERROR_EXIT,
    SettingError,
    WorkerSettings,
    flag_name,
    settings_problems,
    threads_per_rank,
)
from trainer_core.slots import RunSlot
from trainer_core.step import StepResult, train_step

log = logging.getLogger("loraloom.worker")

CLAIM_AHEAD_PACKS = 4
"""Claim more rollout batches of any run only while fewer than this many packs' worth of tokens are
buffered; above it, only for the runs short of a pack (`PoolTrainer._claim`)."""
BASE_SAMPLING_POLL_S = 1.0
"""How often a pool without Tinker models asks for manual work (base-model sampling requests)."""


@dataclass
class WorkerArgs:
    url: str = "http://127.0.0.1:8000"
    token: str | None = None
    """The service's worker token (not needed with `runs_dir`)."""
    runs_dir: Path | None = None
    """Train the `run_*` directories under this directory instead of the service's runs."""
    base_model: str = DEFAULT_BASE_MODEL
    max_rank: int = 16
    slots: int = 4
    """Concurrent runs (LoRA slots) this pool trains."""
    seq_len: int = 1024
    """Tokens per packed micro-batch; also the longest sample the pool accepts."""
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    checkpoint_dir: Path = Path("./.loraloom/data/runs")
    """Per-run checkpoints go to checkpoint_dir/<run_id>/checkpoints/step_N (with `runs_dir`: the runs'
    own directories, see `checkpoint_home`)."""
    model_cache_dir: Path = Path("./.loraloom/models")
    poll_interval_s: float = 0.2
    pack_timeout_s: float = 2.0
    max_claim: int = 64
    pad_to_multiple_of: int = 8
    device: str = "auto"
    dtype: str = "auto"
    attention: str = "auto"
    gradient_checkpointing: bool = False
    exit_when_idle_s: float | None = None
    """Stop after this long with no active run and nothing buffered (tests, benchmarks)."""
    heartbeat_file: Path | None = None
    """Touched after every accepted heartbeat (the container healthcheck reads its age)."""
    sampler_url: str | None = None
    """Tinker `sample` served by this OpenAI-compatible server (trainer_core.external_sampler)."""
    sampler_deadline_s: float = 600.0
    """Seconds a round of exchanges with `sampler_url` may take in all (`ExternalSampler.deadline_s`)."""
    sampler_max_response_bytes: int = 256 * 1024**2
    """The largest answer read from `sampler_url` (`ExternalSampler.max_response_bytes`)."""
    sampler_concurrency: int = 8
    """Requests in flight at once to `sampler_url` (`ExternalSampler.concurrency`)."""

    @classmethod
    def from_settings(cls, s: WorkerSettings) -> "WorkerArgs":
        return cls(
            url=s.url,
            token=s.token,
            runs_dir=s.runs_dir,
            base_model=s.base_model,
            max_rank=s.max_rank,
            slots=s.slots,
            seq_len=s.seq_len,
            target_modules=s.target_modules,
            checkpoint_dir=s.checkpoint_home if s.runs_dir is None else s.data_dir / "runs",
            model_cache_dir=s.model_cache_dir,
            poll_interval_s=s.poll_interval,
            pack_timeout_s=s.pack_timeout,
            max_claim=s.max_claim,
            device=s.device,
            dtype=s.dtype,
            attention=s.attention,
            gradient_checkpointing=s.gradient_checkpointing,
            exit_when_idle_s=s.exit_when_idle,
            heartbeat_file=s.heartbeat_file,
            sampler_url=s.sampler_url,
            sampler_deadline_s=s.sampler_deadline,
            sampler_max_response_bytes=s.sampler_max_response_bytes,
            sampler_concurrency=s.sampler_concurrency,
        )

    @property
    def checkpoint_home(self) -> Path:
        """The directory holding `<run_id>/checkpoints/`: the run directories themselves in directory mode."""
        return self.runs_dir if self.runs_dir is not None else self.checkpoint_dir


def parse_args(argv: list[str] | None = None) -> WorkerArgs:
    """`WorkerSettings` from the environment, overridden by the flags given; one flag per setting."""
    settings = parse_settings(argv)
    if not settings.token and settings.runs_dir is None:
        raise SystemExit(
            "trainer_core.worker: error: --worker-token or LORALOOM_WORKER_TOKEN is required "
            "(or --runs-dir to train without the service)"
        )
    return WorkerArgs.from_settings(settings.resolved())


def parse_settings(argv: list[str] | None = None) -> WorkerSettings:
    p = argparse.ArgumentParser(prog="trainer_core.worker", description=(__doc__ or "").splitlines()[0])
    for name, info in WorkerSettings.model_fields.items():
        # Every flag is optional: what is not given comes from LORALOOM_* or the default.
        p.add_argument(flag_name(name), dest=name, default=None, help=info.description)
    p.add_argument("--token", dest="worker_token", default=None, help="alias of --worker-token")
    given = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    try:
        return WorkerSettings(**given)
    except ValidationError as exc:  # a usage error (exit 2) naming what the user set, as argparse's are
        problems = settings_problems(exc, given=given, environ=os.environ)
        p.exit(2, f"{p.prog}: error: invalid worker settings: {problems}\n")


def make_source(args: WorkerArgs, *, stop: Callable[[], bool] | None = None) -> RunSource:
    """The run directories of `--runs-dir`, or the service at `--url`. `stop`: True once the pool is
    stopping; the service client then gives up a failing request instead of retrying it."""
    if args.runs_dir is not None:
        return DirectoryRunSource(args.runs_dir)
    if not args.token:
        raise ValueError("the service needs the worker token (WorkerArgs.token)")
    client = PoolServiceClient(args.url, args.token, stop=stop)
    return HttpRunSource(client, heartbeat_file=args.heartbeat_file)


def external_sampler(args: WorkerArgs) -> ExternalSampler | None:
    """The server that decodes Tinker `sample` (`--sampler-url`) with the operator's bounds on each
    exchange; None when the pool decodes them itself."""
    if args.sampler_url is None:
        return None
    return ExternalSampler(
        args.sampler_url,
        args.checkpoint_home,
        args.base_model,
        deadline_s=args.sampler_deadline_s,
        max_response_bytes=args.sampler_max_response_bytes,
        concurrency=args.sampler_concurrency,
    )


@dataclass
class LoopTime:
    """Where the loop's wall time went: training steps (with their claims, packing and pushes) or idle
    polls while at least one run was admitted (the time the pack rule and timeout cost)."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    """Idle polls while runs were admitted (a pool with no run is not counted)."""
    steps: int = 0

    def add(self, *, busy: float = 0.0, idle: float = 0.0, has_runs: bool = True) -> None:
        self.busy_s += busy
        self.steps += busy > 0
        if has_runs:
            self.idle_s += idle

    @property
    def idle_share(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total else 0.0

    def summary(self) -> str:
        return (
            f"{self.steps} steps, busy {self.busy_s:.1f} s, idle with runs {self.idle_s:.1f} s "
            f"(idle share {100 * self.idle_share:.0f} %)"
        )


@dataclass
class Plan:
    """What every rank does in one iteration; the master decides it."""

    kind: Literal["stop", "idle", "train"]
    completing: dict[int, int] = field(default_factory=dict)
    """slot -> the step that the micro-batches of this iteration complete (those runs step)."""
    micro_batches: list[list[MicroBatch]] | None = None
    """Master only: one list per rank, scattered (every rank receives only its own)."""


@dataclass
class _Master:
    """What only the master rank holds: the run source, the packer, the publisher."""

    source: RunSource
    packer: Packer
    publisher: Publisher
    idle_since: float = field(default_factory=time.monotonic)
    run_files: RunFiles | None = None
    """Removes deleted runs' files from the checkpoint home (a source that knows deletions only)."""


@dataclass
class _ClaimsUntilStop:
    """Master: the service's manual work, none claimed once the pool is stopping. A round that claims
    nothing runs nothing on any rank (they follow the master's broadcast claim), so the loop goes on
    to the plan, whose broadcast carries the stop to every rank: under a steady Tinker load the pool
    still stops after the round in progress, with no collective added to the rounds. What it leaves
    unclaimed stays queued at the service for the next pool."""

    client: ManualWorkClient
    stopping: Callable[[], bool]

    def claim_manual(self, max_items: int) -> list[ManualWorkItem]:
        return [] if self.stopping() else self.client.claim_manual(max_items)

    def report_manual(self, results: list[ManualResult]) -> None:
        self.client.report_manual(results)  # the round in progress still answers what it ran


class PoolTrainer:
    """The pool on one rank: `__init__` (base model, LoRA slots, optimizers; on the master also the run
    source, the packer and the publisher), `run()` (the loop of the module docstring), `close()`."""

    def __init__(
        self, args: WorkerArgs, *, world: World, device: torch.device, source: RunSource | None = None
    ) -> None:
        """`source`: where the master gets runs and batches (made from `args` when None; tests and
        benchmarks pass an `HttpRunSource` over an in-memory client, `MemoryPoolClient`)."""
        self.args = args
        self.world = world
        self.device = device
        self.stop_requested = False
        self._stepped = False
        self._last_base_sampling_poll = -math.inf
        self.loop_time = LoopTime()

        # Every rank builds the same base model; the master builds the cache first.
        load = partial(
            load_base_model,
            args.base_model,
            cache_dir=args.model_cache_dir,
            dtype=args.dtype,
            attn_implementation=args.attention,
            device=device,
        )
        failure = ""  # the master's: the other ranks, waiting for its cache, stop with it
        if world.is_master:
            pause_at(STARTUP_BEFORE_MODEL)  # tests: a stop signal while the pool builds its model
            log.info("loading the base model %s (cache %s)", args.base_model, args.model_cache_dir)
            try:
                base = _load_or_explain(load)
            except SettingError as exc:
                failure = str(exc)
        failure = broadcast_from_master(failure, world)
        if failure:
            raise SettingError(failure, every_rank=True)
        if not world.is_master:
            base = _load_or_explain(load)
        log.info("rank %d: base model %s loaded", world.rank, args.base_model)
        self.vocab_size = int(base.config.vocab_size)
        # A plain Module from here on (transformers types `PreTrainedModel.to` in a way mypy cannot call).
        self.model = cast(nn.Module, base)
        check_target_modules(self.model, args)
        self.model.to(device)
        self.lora = apply_multi_lora(self.model, args.target_modules, args.slots, args.max_rank)
        if args.gradient_checkpointing:
            self.lora.enable_gradient_checkpointing()
            log.info("rank %d: gradient checkpointing on (layers recomputed in the backward)", world.rank)
        self.model.train()
        self.optimizer = MultiRunOptimizer(args.slots)
        # One linear critic per slot, used by runs with GAE advantages (trainer_core.critic).
        self.value_heads = ValueHeads(args.slots, int(base.config.hidden_size)).to(device)
        self.slots: dict[int, RunSlot] = {}
        """The active runs by slot, the same on every rank (master: with their packing state)."""

        self.master: _Master | None = None
        if world.is_master:
            # Stopping, the pool asks the service once, not for a minute of retries (a Ctrl-C while
            # the service was down took that minute, then ended in RetryExhausted's traceback).
            self.master = self._start_master(source or make_source(args, stop=lambda: self.stop_requested))
        self.manual: ManualExecutor | None = None
        """Executes the manual-mode work (Tinker API) if the source serves any: the master claims
        and reports, every rank runs its share."""
        client = getattr(self.master.source, "client", None) if self.master else None
        if broadcast_from_master(isinstance(client, ManualWorkClient) if self.master else None, world):
            self.manual = ManualExecutor(
                _ClaimsUntilStop(client, stopping=lambda: self.stop_requested)
                if isinstance(client, ManualWorkClient)
                else None,
                seq_len=args.seq_len,
                checkpoint_dir=args.checkpoint_home,
                world=world,
                vocab_size=self.vocab_size,
                text_decoder=partial(load_text_decoder, args.base_model, args.model_cache_dir),
                external_sampler=external_sampler(args),
            )
        self.runs = MultiRunManager(
            self.master.source if self.master else None,
            args.slots,
            world=world,
            check=partial(
                pool_config_problems,
                base_model=args.base_model,
                max_rank=args.max_rank,
                target_modules=args.target_modules,
                seq_len=args.seq_len,
            ),
        )

    def _start_master(self, source: RunSource) -> _Master:
        args = self.args
        source.open(
            PoolRegister(
                base_model=args.base_model,
                vocab_size=self.vocab_size,
                max_rank=args.max_rank,
                target_modules=list(args.target_modules),
                slots=args.slots,
                world_size=self.world.world_size,
                max_seq_len=args.seq_len,
                module_shapes=module_shapes(self.lora),
                num_layers=len({name.split(".self_attn.")[0].split(".mlp.")[0] for name in self.lora.layers}),
            )
        )
        packer = Packer(
            n_slots=args.slots,
            seq_len=args.seq_len,
            dp_world_size=self.world.world_size,
            pad_to_multiple_of=args.pad_to_multiple_of,
            timeout_s=args.pack_timeout_s,
            vocab_size=self.vocab_size,
        )
        publisher = Publisher(
            source=source,
            lora=self.lora,
            optimizer=self.optimizer,
            base_model=args.base_model,
            checkpoint_dir=args.checkpoint_home,
            value_heads=self.value_heads,
        )
        run_files = None
        if isinstance(source, DeletedRunsSource):
            # Before any admission: what the pool holds files for and the service deleted (while
            # this pool was down, or held by none) goes now (trainer_core.run_files).
            run_files = RunFiles(args.checkpoint_home, source)
            run_files.start()
        return _Master(source=source, packer=packer, publisher=publisher, run_files=run_files)

    # -- slots: admitted and released on every rank, in the same order ----------------------------

    def admit_slot(self, slot: int, run_id: str, config: RunConfig) -> None:
        """Give `run_id` the slot: a fresh adapter and optimizer, then its newest checkpoint if any."""
        self.lora.configure_slot(
            slot,
            rank=config.lora.rank,
            alpha=config.lora.alpha,
            dropout=config.lora.dropout,
            target_modules=config.lora.target_modules,  # the run's modules only (pool_config_problems)
        )
        # Seeded by the run's config alone: every rank gets the same initial adapter, and a run's
        # adapter does not depend on which slot it got or which runs came before it (isolation).
        self.lora.reset_slot(slot, seed=config.seed)
        initial = load_initial_weights(
            lora=self.lora,
            slot=slot,
            run_id=run_id,
            config=config,
            checkpoint_home=self.args.checkpoint_home,
            source=self.master.source if self.master else None,
            world=self.world,
        )
        self.value_heads.reset_slot(slot)
        if initial.value_head is not None and uses_critic(config):
            self.value_heads.load_slot_state_dict(slot, initial.value_head)
        self.optimizer.create(
            slot,
            self.lora.slot_parameters(slot)
            + (self.value_heads.slot_parameters(slot) if uses_critic(config) else []),
            optim=config.optim,
            scheduler=config.scheduler,
            max_steps=config.max_steps,
        )
        if initial.optimizer_state is not None:
            self.optimizer.load_state_dict(slot, initial.optimizer_state)
        progress = restore_slot(
            lora=self.lora,
            optimizer=self.optimizer,
            slot=slot,
            checkpoint_dir=self.args.checkpoint_home,
            run_id=run_id,
            value_heads=self.value_heads,
        )
        run = RunSlot(slot, run_id, config, progress, ledger=RunLedger(next_sample=progress.total_samples))
        if config.mode == "manual":
            run.manual_boundary = restore_manual_boundary(self.args.checkpoint_home, run_id)
        self.slots[slot] = run
        if self.master and initial.error is not None and self.stop_requested:
            # Not evicted: stopping, a failed fetch of the weights is not retried (RetryStopped), so
            # the failure may be the stop's. The run takes no work here; the next pool loads them.
            run.leaving = f"its init_from weights were not loaded while stopping: {initial.error}"
            self.runs.release_run(slot, run.leaving)
        elif self.master and initial.error is not None:
            # Failed, not evicted: the run cannot start, and its failure_reason says why.
            reason = f"its init_from weights could not be loaded: {initial.error}"
            self.runs.fail_run(slot, reason)
            run.leaving = f"failed: {reason}"
        log.info("rank %d: run %s in slot %d from step %d", self.world.rank, run_id, slot, progress.step)
        if self.master is None:
            return
        m = self.master
        m.packer.add_run(
            slot,
            batch_size=config.batch_size,
            progress=run.progress,
            trains_on_rewards=config.advantage.estimator == "gae",
        )
        # Exactly-once: everything handed out after the checkpoint comes back. The run may have left
        # since the state sync listed it (then it is released again at the next sync).
        if not self._for_run(run, "restart", lambda: m.source.restart_run(run_id, progress)):
            return
        # Checkpointed at its last step, yet still listed: the pool stopped before the source got
        # that step's report. Nothing is left to train; report it again so the run completes.
        if progress.step >= config.max_steps and self._for_run(
            run, "completion report", lambda: m.publisher.report_completed(run)
        ):
            run.leaving = f"completed its {progress.step} steps (report repeated after a restart)"

    def release_slot(self, slot: int) -> None:
        """Forget the run in `slot`: adapter, optimizer and gradients, buffered samples, ledger, metrics.

        Every rank calls it for the same slot at the same point of the loop (`_sync_slots`); a run
        that must leave mid-step is marked `leaving` on the master and released at the next sync.
        """
        run = self.slots.pop(slot)
        self.optimizer.remove(slot)
        self.lora.reset_slot(slot)
        self.value_heads.reset_slot(slot)
        if self.master:
            self.master.packer.remove_run(slot)
            self.master.source.release_run(run.run_id)
            if run.config.mode == "manual":
                # Only the master keeps them; a run leaves for good, so no sampler reads them again.
                remove_sampler_weights(self.args.checkpoint_home, run.run_id)
            if self.master.run_files is not None:
                # Deleted, or only evicted/completed (its checkpoints stay)? The next check asks.
                self.master.run_files.left(run.run_id)
        why = f" ({run.leaving})" if run.leaving else ""
        log.info("rank %d: run %s left slot %d%s", self.world.rank, run.run_id, slot, why)

    def _pool_lost(self, m: _Master) -> bool:
        """Master: the service no longer knows this pool (its heartbeat, or a Tinker claim or report,
        was answered pool_dead / pool_stopped): training on would duplicate work handed to another."""
        return m.source.lost or (self.manual is not None and self.manual.lost)

    def _sync_slots(self) -> None:
        # A lost pool asks nothing more (the service would refuse it); the loop stops at the plan.
        if self.master and not self._pool_lost(self.master):
            self.runs.discover_runs()
        changes = self.runs.synchronize_state()
        for slot, _ in changes.released:
            self.release_slot(slot)
        for slot, run_id, config in changes.admitted:
            self.admit_slot(slot, run_id, config)
        if self.master and self.master.run_files is not None and not self._pool_lost(self.master):
            # Master alone, between steps (no rank reads a deleted run's files: the service lists it
            # no more, and keeps a checkpoint an init_from still names).
            self.master.run_files.check(held={run.run_id for run in self.slots.values()})

    # -- the loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        while True:
            began = time.perf_counter()
            self._sync_slots()
            # A stopping master claims no manual work (`_ClaimsUntilStop`): this returns False on
            # every rank then, and the plan below stops them all together.
            served = self._serve_manual()
            if served and self.master:
                self.master.idle_since = time.monotonic()  # serving Tinker work is not idling
            # The plan follows every round, manual work or not: a steady Tinker load (a round after
            # round) must not hold off the rollout runs' steps, another tenant's, for as long as it
            # lasts. The master decides; every rank follows the same plan, so collectives stay matched.
            plan, my_micro_batches = self._distribute(self._plan(self.master) if self.master else None)
            if plan.kind == "stop":
                if served:
                    # One more round, as the loop's next turn ran before the plan followed every
                    # round: it claims nothing (stopping or lost) and, on a pool the service declared
                    # lost, drops the Tinker state every rank holds (trainer_core.manual).
                    self._serve_manual()
                break
            if plan.kind == "idle":
                if served:  # more Tinker work may be waiting: no poll interval's sleep
                    self.loop_time.add(busy=time.perf_counter() - began)
                    continue
                time.sleep(self.args.poll_interval_s)
                self.loop_time.add(idle=time.perf_counter() - began, has_runs=bool(self.slots))
                continue
            first = not self._stepped
            if first and self.world.is_master:
                log.info("first training step: %d micro-batches on this rank", len(my_micro_batches))
                started = time.monotonic()
            result = train_step(
                model=self.model,
                lora=self.lora,
                optimizer=self.optimizer,
                micro_batches=my_micro_batches,
                loss_settings={slot: run.config.loss for slot, run in self.slots.items()},
                completing=plan.completing,
                world=self.world,
                advantage_settings={slot: run.config.advantage for slot, run in self.slots.items()},
                value_heads=self.value_heads,
                device=self.device,
            )
            if first and self.world.is_master:
                log.info("first training step done in %.1f s", time.monotonic() - started)
            self._stepped = True
            if self.master:
                self._after_step(self.master, plan, result)
            self.loop_time.add(busy=time.perf_counter() - began)
        log.info("rank %d: %s", self.world.rank, self.loop_time.summary())

    def _serve_manual(self) -> bool:
        """One round of manual work (trainer_core.manual), on every rank at this point of the loop;
        True when some ran (then the loop starts over). Decided from what every rank knows alike:
        the slots' modes (not `leaving`, the master's alone) and the master's broadcast claim."""
        if self.manual is None:
            return False
        if not any(run.config.mode == "manual" for run in self.slots.values()):
            # No Tinker model here: only base-model sampling (which needs no run) can be pending,
            # so ask the service now and then rather than at every turn of the loop. The master's
            # clock decides for every rank (ranks' clocks differ; they must enter serve() together).
            due = None
            if self.master is not None:
                now = time.monotonic()
                due = now - self._last_base_sampling_poll >= BASE_SAMPLING_POLL_S
                if due:
                    self._last_base_sampling_poll = now
            if not broadcast_from_master(due, self.world):
                return False
        return self.manual.serve(
            model=self.model,
            lora=self.lora,
            optimizer=self.optimizer,
            slots=self.slots,
            publisher=self.master.publisher if self.master else None,
        )

    def _plan(self, m: _Master) -> Plan:
        """Master: claim batches, pack if ready."""
        if self.stop_requested or self._pool_lost(m):
            return Plan("stop")
        for claimed in self._claim(m):
            self._feed(m, claimed)
        result = m.packer.pack() if m.packer.is_ready() else None
        if result is None:
            return Plan("stop") if self._should_exit(m) else Plan("idle")
        m.idle_since = time.monotonic()
        completing: dict[int, int] = {}
        fill = result.fill()
        for slot, pack in result.runs.items():
            run = self.slots[slot]
            run.ledger.consumed(pack.samples_per_batch())
            run.step_metrics.add_pack(pack, fill=fill)
            if pack.step_completed and run.leaving is None:
                completing[slot] = pack.step
        return Plan("train", completing, result.micro_batches)

    def _claim(self, m: _Master) -> list[ClaimedBatchStruct]:
        """Master: the batches to buffer before this plan packs.

        What sits in memory is leased, and a flood of batches from one run must stay in the source's
        queue, not in this process: of any run, claim only while the buffer is short of a few packs.
        Above that, one run's huge batch would hold every other run off for as long as it takes to
        train. So the runs with less than a pack's worth of their own still claim, for themselves
        alone (`run_ids`), as many batches as there are such runs: the packer's round-robin gives
        them their turn in the next packs, and the buffer beyond the cap stays within about a pack
        plus its last claim's batches per run.
        """
        training = [run for run in self.slots.values() if run.leaving is None]
        if not training:
            return []
        if m.packer.buffered_tokens() < CLAIM_AHEAD_PACKS * m.packer.token_budget:
            return m.source.claim(self.args.max_claim)
        short = [
            run.run_id
            for run in training
            if run.config.mode != "manual"  # a Tinker model's run gets no rollout batches
            and m.packer.buffered_tokens(run.slot) < m.packer.token_budget
        ]
        if not short:
            return []
        return m.source.claim(min(len(short), self.args.max_claim), run_ids=short)

    def _feed(self, m: _Master, claimed: ClaimedBatchStruct) -> None:
        run = next((r for r in self.slots.values() if r.run_id == claimed.run_id), None)
        if run is None or run.leaving is not None:
            return  # the run left the pool since the claim (the service's lease expires)
        fresh = run.ledger.add(
            batch_id=claimed.id, sample_offset=claimed.sample_offset, num_samples=claimed.num_samples
        )
        if fresh == 0:
            return
        try:
            m.packer.add_batch(
                run.slot, claimed.payload, batch_id=claimed.id, skip=claimed.num_samples - fresh
            )
        except ValueError as exc:  # InvalidSampleError, or a batch-level field the packer refuses
            self._evict(run, f"trainer rejected batch {claimed.id}: {exc}")

    def _distribute(self, plan: Plan | None) -> tuple[Plan, list[MicroBatch]]:
        """Master → all: the plan (without micro-batches) and each rank's own micro-batches."""
        header = broadcast_from_master(
            dataclasses.replace(plan, micro_batches=None) if plan else None, self.world
        )
        if header.kind != "train":
            return header, []
        mine: list[MicroBatch] = scatter_from_master(plan.micro_batches if plan else None, self.world)
        return header, mine

    def _after_step(self, m: _Master, plan: Plan, result: StepResult) -> None:
        """Master: record the step's statistics, evict broken runs, publish every completed step."""
        for slot, run in self.slots.items():
            run.step_metrics.add_loss(result.stats.slot(slot))
        for slot in sorted(result.nonfinite):
            self._evict(self.slots[slot], "non-finite loss or gradients (NaN/Inf) in this run's step")
        pause_before_publish([self.slots[slot].run_id for slot in plan.completing])
        for slot, step in sorted(plan.completing.items()):
            run = self.slots[slot]
            if slot not in result.stepped or run.leaving is not None:
                continue
            stats = result.stepped[slot]
            if not self._for_run(run, f"step {step}", partial(m.publisher.publish_step, run, step, stats)):
                continue
            if step >= run.config.max_steps:
                run.leaving = f"completed its {step} steps"

    def _for_run(self, run: RunSlot, what: str, call: Callable[[], object]) -> bool:
        """Master: `call` (a request about `run` alone); False if the answer says the run has left.

        Between the state sync and the publish the run may have been evicted, deleted, completed or
        failed, or its tenant removed (`trainer_core.run_left`). That is the run's business only:
        its slot is released on every rank at the next sync (adapter, optimizer, gradients,
        buffered samples, ledger) and every other run trains on. Other errors still raise.
        """
        try:
            call()
        except ApiError as exc:
            if not run_has_left(exc):
                raise
            log.warning(
                "run %s has left the pool (%s: %s); releasing slot %d", run.run_id, what, exc, run.slot
            )
            if run.leaving is None:
                run.leaving = f"left during its {what}: {exc}"
                self.runs.release_run(run.slot, run.leaving)
            return False
        return True

    def _evict(self, run: RunSlot, reason: str) -> None:
        if run.leaving is None:
            self.runs.evict_run(run.slot, reason)
            run.leaving = f"evicted: {reason}"

    def _should_exit(self, m: _Master) -> bool:
        limit = self.args.exit_when_idle_s
        return (
            limit is not None
            and not self.slots
            and m.packer.buffered_tokens() == 0
            and time.monotonic() - m.idle_since > limit
        )

    # -- cleanup ----------------------------------------------------------------------------------

    def close(self) -> None:
        if self.master:
            self.master.source.close()
        if self.manual is not None and self.manual.external_sampler is not None:
            self.manual.external_sampler.close()


def _load_or_explain(load: Callable[[], PreTrainedModel]) -> PreTrainedModel:
    try:
        return load()
    except (BaseModelError, FileNotFoundError) as exc:
        raise SettingError(
            f"{str(exc).rstrip('.')}. Check --base-model (LORALOOM_BASE_MODEL: a local model directory, "
            "a hub id that can be downloaded or is in the Hugging Face cache, or loraloom-tiny), and "
            "--attention and --dtype if the reason is about them"
        ) from exc


def check_target_modules(model: nn.Module, args: WorkerArgs) -> None:
    """Every --target-modules name is the last name component of a linear layer of the model (else
    `apply_multi_lora` raises, and the rank printed a traceback that did not list the names)."""
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )
    missing = [name for name in args.target_modules if name not in linear]
    if missing:
        raise SettingError(
            f"--target-modules (LORALOOM_TARGET_MODULES): the base model {args.base_model} has no linear "
            f"layer named {', '.join(missing)}; its linear layers are {', '.join(linear)}",
            every_rank=True,  # the same model on every rank
        )


def main(argv: list[str] | None = None) -> None:
    die_with_parent()  # again, for callers of main() other than `-m trainer_core.worker`
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the log
    args = parse_args(argv)
    world = World.from_env()
    device = pick_device(args.device, world)
    init_world(world, device)
    torch.manual_seed(0)  # every rank must build identical LoRA initialisations
    # Split the cores between ranks unless the launcher said otherwise (OMP_NUM_THREADS).
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else threads_per_rank(world.world_size))
    try:
        trainer = PoolTrainer(args, world=world, device=device)
    except SettingError as exc:
        # One line that says what to change, not a traceback per rank: the master's for an error
        # every rank raised alike, else the rank's that found it.
        if world.is_master or not exc.every_rank:
            log.error("cannot start the worker pool: %s", exc)
        destroy_world()
        raise SystemExit(SETTING_ERROR_EXIT) from None

    def _request_stop(signum: int, _frame: FrameType | None) -> None:
        # First SIGINT/SIGTERM (torchrun passes the launcher's on to every rank): the master ends
        # the loop after the current step and every rank follows its "stop" plan; the pool then
        # deregisters (its leases return at once). A second one leaves right away.
        if trainer.stop_requested:
            raise KeyboardInterrupt
        log.info(
            "rank %d: %s received; stopping after the current step", world.rank, signal.Signals(signum).name
        )
        trainer.stop_requested = True

    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    try:
        trainer.run()
    except RetryStopped as exc:
        # Master: a request failed after the stop (the service is down): stop without it. `close`
        # tries to deregister once; if that fails too, the service's pool timeout frees the leases.
        log.warning("rank %d: stopping without the service: %s", world.rank, exc)
    except RuntimeError as exc:
        # Another rank, stopping too: the master left (above) while this one waited in a collective
        # for its plan, so the collective broke. That is the stop, not a failure of this rank (gloo's
        # message says "typically caused by a remote worker crashing": only for --debug eyes).
        # A device's own error (CUDA, out of memory) is no broken collective: it shows, stop or not.
        device_error = is_fatal_device_error(exc) or isinstance(exc, torch.OutOfMemoryError)
        if not trainer.stop_requested or world.is_master or device_error:
            raise
        log.info("rank %d: the master rank stopped first; stopping with it", world.rank)
        log.debug("rank %d: the collective it broke: %s", world.rank, exc)
    finally:
        trainer.close()
        destroy_world()
        log.info("rank %d: stopped", world.rank)


if __name__ == "__main__":
    main()
    # Everything is released (leases, process group, files); skip the interpreter's teardown of
    # torch and its threads, which takes seconds on a loaded machine, so Ctrl-C ends the pool fast.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
