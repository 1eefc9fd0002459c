"""Which runs the worker pool trains, in which slot, and how every rank agrees on it.

A `RunSource` reports the runs that should be training (the service over HTTP, or
`run_*` directories as in the source documents); the `MultiRunManager` turns those
reports into slot indices 0..max_runs-1, validated configs and progress, and runs
the lifecycle hooks that per-run components (optimizers, schedulers, the packer)
register. Life of a run, as seen by the manager:

    listed by the source ──▶ validated (RunConfig + validation hooks)
        invalid ──▶ source.report_invalid_config(...)        (not admitted; retried when it changes)
        valid   ──▶ waiting for a slot (oldest seen first) ──▶ admitted: idx assigned
    admitted ──▶ no longer listed (deleted, evicted) ──▶ forgotten: idx freed

Only the master rank (rank 0) talks to the source, in `discover_runs()`. Every rank
then calls `synchronize_state()`, which broadcasts the master's view and runs the
deletion hooks, then the creation hooks, on every rank in the same order, so hooks
may themselves use collectives (DTensor creation, barriers).

There is no module-level state: build one manager and pass it to whoever needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from pydantic import ValidationError

from contracts.durable import atomic_write_text
from contracts.ids import is_valid_run_id, validate_run_id
from contracts.layout import CONFIG_ERROR_FILE, CONTROL_DIR, EVICTED_FILE, ORCH_CONFIG_FILE
from contracts.progress import Progress
from contracts.run_config import RunConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecord:
    """What a source reports about one run that should be training (not evicted)."""

    run_id: str
    raw_config: dict[str, Any] | None
    """The run's config as plain data, validated by the manager. None: no usable config yet
    (the source has already reported why, if there is a reason); the run is not admitted."""
    slot_hint: int | None = None
    """The slot the source wants this run in (the service assigns slots); honoured when free."""
    progress: Progress | None = None
    """Where the run stands when it is admitted (a resumed run); None starts at zero."""


class RunSource(Protocol):
    """Where the master rank learns which runs to train, and reports back about them."""

    def list_runs(self) -> list[RunRecord]:
        """Every run that should be training now (evicted runs left out), oldest first."""
        ...

    def evict(self, run_id: str, reason: str) -> None:
        """Stop the run for good; it disappears from later `list_runs()` answers."""
        ...

    def report_invalid_config(self, run_id: str, message: str) -> None:
        """Tell the run's owner that its config was rejected, and why."""
        ...

    def clear_invalid_config(self, run_id: str) -> None:
        """Withdraw an earlier `report_invalid_config` (the config is valid now)."""
        ...


@runtime_checkable
class HasRunDirs(Protocol):
    """A source whose runs live in directories (checkpoints, rollouts, broadcast)."""

    def run_dir(self, run_id: str) -> Path: ...


class DirectoryRunSource:
    """Runs as `run_*` directories under `output_dir`, laid out as in the source documents:

    `{run}/control/orch.toml` (the config; the run is not ready until it exists),
    `{run}/control/evicted.txt` (the eviction reason; the run is skipped),
    `{run}/control/config_validation_error.txt` (why the config was rejected).

    Writers of `orch.toml` should replace it atomically: every `RunConfig` field has a
    default, so a half-written file that happens to parse is a valid (wrong) config.
    """

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = Path(output_dir)
        # run_id -> (stat signature of orch.toml, parsed dict or None on a syntax error).
        # Re-parsing every file on every trainer step would be wasted work, and a syntax
        # error is reported once per version of the file, not once per step.
        self._parsed: dict[str, tuple[tuple[int, int, int], dict[str, Any] | None]] = {}
        self._warned_names: set[str] = set()

    def run_dir(self, run_id: str) -> Path:
        return self.output_dir / validate_run_id(run_id)

    def control_dir(self, run_id: str) -> Path:
        return self.run_dir(run_id) / CONTROL_DIR

    def list_runs(self) -> list[RunRecord]:
        if not self.output_dir.is_dir():
            return []
        records: list[RunRecord] = []
        parsed: dict[str, tuple[tuple[int, int, int], dict[str, Any] | None]] = {}
        # Sorted by name: within one scan there is no reliable creation order (directory
        # mtimes move whenever a child changes); the manager keeps first-seen order across scans.
        for entry in sorted(self.output_dir.iterdir(), key=lambda p: p.name):
            name = entry.name
            if not name.startswith("run_") or not entry.is_dir():
                continue
            if not is_valid_run_id(name):
                if name not in self._warned_names:
                    self._warned_names.add(name)
                    logger.warning("ignoring run directory %r: not a valid run id", name)
                continue
            control = entry / CONTROL_DIR
            if (control / EVICTED_FILE).exists():
                continue
            orch = control / ORCH_CONFIG_FILE
            try:
                st = orch.stat()
            except FileNotFoundError:
                continue  # not ready yet: its orchestrator has not written a config
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
            cached = self._parsed.get(name)
            if cached is not None and cached[0] == signature:
                raw = cached[1]
            else:
                try:
                    raw = tomllib.loads(orch.read_text(encoding="utf-8"))
                except FileNotFoundError:
                    continue  # deleted between stat and read
                except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                    raw = None
                    message = f"control/{ORCH_CONFIG_FILE} is not valid TOML: {exc}"
                    logger.warning("run %s: %s", name, message)
                    self.report_invalid_config(name, message)
            parsed[name] = (signature, raw)
            records.append(RunRecord(run_id=name, raw_config=raw))
        self._parsed = parsed  # forget runs that are gone, evicted or not ready
        return records

    def evict(self, run_id: str, reason: str) -> None:
        control = self.control_dir(run_id)
        if not control.parent.is_dir():
            # Deleting the directory already stopped the run; recreating it would leave a ghost.
            logger.warning("not evicting run %s: its directory %s is gone", run_id, control.parent)
            return
        control.mkdir(exist_ok=True)
        atomic_write_text(control / EVICTED_FILE, reason)

    def report_invalid_config(self, run_id: str, message: str) -> None:
        control = self.control_dir(run_id)
        if not control.is_dir():
            logger.warning("cannot report the invalid config of run %s: %s is gone", run_id, control)
            return
        atomic_write_text(control / CONFIG_ERROR_FILE, message.rstrip("\n") + "\n")

    def clear_invalid_config(self, run_id: str) -> None:
        (self.control_dir(run_id) / CONFIG_ERROR_FILE).unlink(missing_ok=True)


def _format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(config)"


def format_validation_errors(exc: ValidationError) -> list[str]:
    """One line per problem, each naming the field path: `lora.rank: Input should be ... (got 999)`."""
    lines = []
    for err in exc.errors(include_url=False):
        line = f"{_format_loc(tuple(err['loc']))}: {err['msg']}"
        value = err.get("input")
        # The input of a whole-model error is the whole section: too long to be useful.
        if err["type"] != "missing" and not isinstance(value, dict):
            shown = repr(value)
            line += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        lines.append(line)
    return lines


DiscoveredHook = Callable[[int, str, RunConfig], None]
"""(idx, run_id, config): a run was admitted to slot idx (master only)."""
ForgottenHook = Callable[[int, str], None]
"""(idx, run_id): an admitted run is gone and its slot is free again (master only)."""
LifecycleHook = Callable[[int, str], None]
"""(idx, run_id): creation / deletion of a run's per-rank state (every rank, same order)."""
ConfigValidationHook = Callable[[RunConfig], tuple[bool, str]]
"""config -> (ok, message): a check beyond the RunConfig schema (e.g. the pool's maximum rank)."""


class SlotModule(Protocol):
    """A module holding one set of parameters per slot (MultiLoRALinear)."""

    def reset_slot(self, slot: int) -> None: ...

    def slot_parameters(self, slot: int) -> Mapping[str, torch.Tensor] | Iterable[torch.Tensor]:
        """Named (a mapping) or in a fixed order (a sequence; named by position)."""
        ...


@dataclass
class _Candidate:
    """A listed run that has not been admitted: its latest report and validation result."""

    record: RunRecord
    validated: bool = False
    """Whether `validated_raw` holds the raw config of the last validation."""
    validated_raw: dict[str, Any] | None = None
    config: RunConfig | None = None
    """The validated config; None when invalid or not validated."""
    waiting_logged: bool = False


@dataclass
class _SyncState:
    """What the master broadcasts in `synchronize_state()`."""

    idx_2_id: dict[int, str]
    config: dict[int, RunConfig]
    progress: dict[int, Progress]
    ready_to_update: list[bool]


class MultiRunManager:
    """Slots, configs, progress and lifecycle hooks of the runs one worker pool trains.

    Loop, on every rank: the master calls `discover_runs()`, updates `progress` and
    `ready_to_update` as it packs, then every rank calls `synchronize_state()`.
    Between two `synchronize_state()` calls non-master ranks see the previous state.
    """

    def __init__(
        self, source: RunSource | None, max_runs: int, *, rank: int = 0, world_size: int = 1
    ) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank {rank} for world_size {world_size}")
        if rank == 0 and source is None:
            raise ValueError("the master rank needs a run source")
        self.source = source
        """Only the master polls it; other ranks may pass None (e.g. only rank 0 talks to the service)."""
        self.max_runs = max_runs
        self.rank = rank
        self.world_size = world_size

        self._idx_2_id: dict[int, str] = {}
        self._id_2_idx: dict[str, int] = {}
        self._config: dict[int, RunConfig] = {}
        self._progress: dict[int, Progress] = {}
        self.ready_to_update: list[bool] = [False] * max_runs
        """Per slot: the run completed a step in the current trainer step (set by the packer)."""

        # Listed but not admitted, in first-seen order (dicts keep insertion order):
        # that order is the queue for free slots.
        self._candidates: dict[str, _Candidate] = {}
        # The id map as of the last synchronize_state(): every rank diffs against it, so
        # the master (whose maps discover_runs() already changed) computes the same
        # deletions and creations as the others.
        self._synced: dict[int, str] = {}
        self._modules: dict[str, SlotModule] = {}

        self.discovered_hooks: list[DiscoveredHook] = []
        self.forgotten_hooks: list[ForgottenHook] = []
        self.creation_hooks: list[LifecycleHook] = []
        self.deletion_hooks: list[LifecycleHook] = []
        self.config_validation_hooks: list[ConfigValidationHook] = []

    # ── read-only views ────────────────────────────────────────────────────────
    # Read-only so nobody can break the id<->idx bijection from outside; the
    # Progress objects themselves stay mutable for the packer.

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def idx_2_id(self) -> Mapping[int, str]:
        return MappingProxyType(self._idx_2_id)

    @property
    def id_2_idx(self) -> Mapping[str, int]:
        return MappingProxyType(self._id_2_idx)

    @property
    def config(self) -> Mapping[int, RunConfig]:
        return MappingProxyType(self._config)

    @property
    def progress(self) -> Mapping[int, Progress]:
        return MappingProxyType(self._progress)

    @property
    def used_idxs(self) -> list[int]:
        """Slots holding a run, ascending (a list, so every rank iterates them in the same order)."""
        return sorted(self._idx_2_id)

    @property
    def unused_idxs(self) -> list[int]:
        return [i for i in range(self.max_runs) if i not in self._idx_2_id]

    @property
    def ready_to_update_idxs(self) -> list[int]:
        return [i for i in self.used_idxs if self.ready_to_update[i]]

    @property
    def waiting_run_ids(self) -> list[str]:
        """Runs with a valid config waiting for a free slot, oldest seen first (master only)."""
        return [rid for rid, c in self._candidates.items() if c.config is not None]

    # ── hooks (plain lists; these only append, as in the source documents) ─────

    def register_discovered_hook(self, hook: DiscoveredHook) -> None:
        self.discovered_hooks.append(hook)

    def register_forgotten_hook(self, hook: ForgottenHook) -> None:
        self.forgotten_hooks.append(hook)

    def register_creation_hook(self, hook: LifecycleHook) -> None:
        self.creation_hooks.append(hook)

    def register_deletion_hook(self, hook: LifecycleHook) -> None:
        self.deletion_hooks.append(hook)

    def register_config_validation_hook(self, hook: ConfigValidationHook) -> None:
        self.config_validation_hooks.append(hook)

    # ── paths ──────────────────────────────────────────────────────────────────

    def get_run_dir(self, idx: int) -> Path:
        if not isinstance(self.source, HasRunDirs):
            raise TypeError(f"the run source {type(self.source).__name__} has no run directories")
        return self.source.run_dir(self._idx_2_id[idx])

    def run_dirs(self) -> list[Path]:
        return [self.get_run_dir(idx) for idx in self.used_idxs]

    # ── master: discovery and eviction ─────────────────────────────────────────

    def _require_master(self, what: str) -> RunSource:
        if not self.is_master or self.source is None:
            raise RuntimeError(f"{what} runs on the master rank only (this is rank {self.rank})")
        return self.source

    def discover_runs(self) -> None:
        """Poll the source and update the master's view (master only).

        Order, as in the source documents: scan (the source leaves evicted runs out),
        detect new and deleted runs, forgotten hooks for deleted runs, validate new
        runs, admit them into free slots, discovered hooks for the admitted runs.
        """
        source = self._require_master("discover_runs()")
        records: dict[str, RunRecord] = {}
        for record in source.list_runs():
            if not is_valid_run_id(record.run_id):
                logger.warning("ignoring run %r from the source: not a valid run id", record.run_id)
            elif record.run_id in records:
                logger.warning("run %s listed twice by the source; keeping the first", record.run_id)
            else:
                records[record.run_id] = record

        deleted = [(idx, rid) for idx, rid in sorted(self._idx_2_id.items()) if rid not in records]
        for idx, rid in deleted:
            for hook in self.forgotten_hooks:
                hook(idx, rid)
            self._delete_run_data(idx)
            logger.info("run %s left slot %d", rid, idx)
        for rid in [rid for rid in self._candidates if rid not in records]:
            del self._candidates[rid]

        for rid, record in records.items():
            if rid in self._id_2_idx:
                continue  # admitted runs keep the config they were admitted with
            candidate = self._candidates.setdefault(rid, _Candidate(record=record))
            candidate.record = record
            self._validate(candidate)

        admitted = self._admit()
        for idx, rid in admitted:
            for hook in self.discovered_hooks:
                hook(idx, rid, self._config[idx])

    def _validate(self, candidate: _Candidate) -> None:
        source = self.source
        assert source is not None
        rid, raw = candidate.record.run_id, candidate.record.raw_config
        if raw is None:
            # Not ready, or unreadable (the source reported why): validate afresh once it is back.
            candidate.validated, candidate.validated_raw, candidate.config = False, None, None
            return
        if candidate.validated and raw == candidate.validated_raw:
            return  # unchanged since the last verdict: do not re-report every step
        candidate.validated, candidate.validated_raw, candidate.config = True, raw, None

        problems: list[str] = []
        try:
            config = RunConfig.model_validate(raw)
        except ValidationError as exc:
            problems = format_validation_errors(exc)
        else:
            for hook in self.config_validation_hooks:
                try:
                    ok, message = hook(config)
                except Exception as exc:  # a config must not be able to crash the pool through a hook
                    logger.exception("config validation hook %r raised on run %s", hook, rid)
                    ok, message = (
                        False,
                        f"validation hook {getattr(hook, '__name__', hook)!r} failed: {exc!r}",
                    )
                if not ok:
                    problems.append(message or f"rejected by {getattr(hook, '__name__', repr(hook))}")
        if problems:
            text = f"Invalid config for run {rid} ({len(problems)} problem{'s' * (len(problems) > 1)}):\n"
            text += "".join(f"- {p}\n" for p in problems)
            logger.warning("%s", text.rstrip())
            source.report_invalid_config(rid, text)
            return
        candidate.config = config
        source.clear_invalid_config(rid)

    def _admit(self) -> list[tuple[int, str]]:
        free = set(self.unused_idxs)
        ready = [c for c in self._candidates.values() if c.config is not None]
        chosen: list[tuple[int, _Candidate]] = []
        # Hints first: the service owns slot assignment, and a run taking the lowest
        # free slot must not push a hinted run out of the slot the service gave it.
        for c in ready:
            hint = c.record.slot_hint
            if hint is not None and hint in free:
                free.discard(hint)
                chosen.append((hint, c))
        hinted = {c.record.run_id for _, c in chosen}
        for c in ready:
            if c.record.run_id in hinted:
                continue
            hint = c.record.slot_hint
            if not free:
                if not c.waiting_logged:
                    c.waiting_logged = True
                    logger.info("run %s waits for a free slot (max_runs=%d)", c.record.run_id, self.max_runs)
                continue
            if hint is not None:
                logger.warning(
                    "run %s: slot hint %d is %s; using the lowest free slot",
                    c.record.run_id,
                    hint,
                    "taken" if 0 <= hint < self.max_runs else "out of range",
                )
            idx = min(free)
            free.discard(idx)
            chosen.append((idx, c))

        admitted = []
        for idx, c in chosen:  # in first-seen order within each pass
            rid = c.record.run_id
            del self._candidates[rid]
            assert c.config is not None
            progress = dataclasses.replace(c.record.progress) if c.record.progress else Progress()
            self._create_run_data(idx, rid, c.config, progress)
            logger.info("run %s admitted to slot %d", rid, idx)
            admitted.append((idx, rid))
        return admitted

    def evict_run(self, idx: int, reason: str) -> None:
        """Stop run `idx` for good (master only). It stays in the maps, and keeps its slot,
        until the next `discover_runs()` no longer sees it."""
        source = self._require_master("evict_run()")
        if idx not in self._idx_2_id:
            raise KeyError(f"no run in slot {idx}")
        run_id = self._idx_2_id[idx]
        source.evict(run_id, reason)
        logger.warning("evicted run %s (slot %d): %s", run_id, idx, reason)

    # ── every rank ─────────────────────────────────────────────────────────────

    def synchronize_state(self) -> None:
        """Make every rank's view equal to the master's, then run, on every rank,
        the deletion hooks of deleted runs, then reset the new runs' slots in the
        registered modules, then the creation hooks of new runs (ascending slot;
        for each run, hooks in registration order). A slot whose run changed counts
        as a deletion and a creation. Collective: every rank must call it."""
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
                raise RuntimeError(
                    f"manager built for rank {self.rank}/{self.world_size}, but torch.distributed "
                    f"says rank {dist.get_rank()}/{dist.get_world_size()}"
                )
        elif self.world_size > 1:
            raise RuntimeError("synchronize_state() with world_size > 1 needs torch.distributed initialised")

        if self.world_size > 1:
            payload: list[Any] = [None]
            if self.is_master:
                payload[0] = _SyncState(
                    idx_2_id=self._idx_2_id,
                    config=self._config,
                    progress=self._progress,
                    ready_to_update=self.ready_to_update,
                )
            # Pickled over the default group; a few KB for max_runs configs.
            dist.broadcast_object_list(payload, src=0)
            if not self.is_master:
                self._apply(payload[0])

        previous, current = self._synced, dict(self._idx_2_id)
        deleted = [(i, rid) for i, rid in sorted(previous.items()) if current.get(i) != rid]
        created = [(i, rid) for i, rid in sorted(current.items()) if previous.get(i) != rid]
        for idx, rid in deleted:
            for hook in self.deletion_hooks:
                hook(idx, rid)
        for idx, _ in created:
            self.reset_run_parameters(idx)  # before creation hooks, so a warm start there sticks
        for idx, rid in created:
            for hook in self.creation_hooks:
                hook(idx, rid)
        self._synced = current

    def _apply(self, state: _SyncState) -> None:
        """Non-master catch-up: take the master's maps, configs, progress and flags."""
        for idx in [i for i, rid in self._idx_2_id.items() if state.idx_2_id.get(i) != rid]:
            self._delete_run_data(idx)
        for idx, rid in sorted(state.idx_2_id.items()):
            if self._idx_2_id.get(idx) != rid:
                self._create_run_data(idx, rid, state.config[idx], state.progress[idx])
            else:
                # Update in place: components may hold on to a run's Progress object.
                p, q = self._progress[idx], state.progress[idx]
                p.step, p.total_tokens, p.total_samples = q.step, q.total_tokens, q.total_samples
        self.ready_to_update[:] = state.ready_to_update

    def _create_run_data(self, idx: int, run_id: str, config: RunConfig, progress: Progress) -> None:
        self._idx_2_id[idx] = run_id
        self._id_2_idx[run_id] = idx
        self._config[idx] = config
        self._progress[idx] = progress
        self.ready_to_update[idx] = False

    def _delete_run_data(self, idx: int) -> None:
        run_id = self._idx_2_id.pop(idx)
        del self._id_2_idx[run_id]
        del self._config[idx]
        del self._progress[idx]
        self.ready_to_update[idx] = False

    # ── per-slot modules (LoRA registration, as in the source documents) ───────

    def register_module(self, name: str, module: SlotModule) -> None:
        """Register a module with one parameter set per slot (e.g. a MultiLoRALinear under its
        qualified name) so that per-run parameters can be gathered and reset by slot."""
        if name in self._modules:
            raise ValueError(f"module {name!r} is already registered")
        self._modules[name] = module

    def get_named_parameters_for_run(self, idx: int) -> list[tuple[str, torch.Tensor]]:
        """The parameters of slot `idx` in every registered module, named `{module}.{param name or position}`."""
        named = []
        for module_name, module in self._modules.items():
            params = module.slot_parameters(idx)
            items = params.items() if isinstance(params, Mapping) else enumerate(params)
            named.extend((f"{module_name}.{pname}", p) for pname, p in items)
        return named

    def get_state_dict_for_run(self, idx: int) -> dict[str, torch.Tensor]:
        """Detached tensors of slot `idx` (for export or broadcast; PEFT key names are export.py's job)."""
        return {name: p.detach() for name, p in self.get_named_parameters_for_run(idx)}

    def reset_run_parameters(self, idx: int) -> None:
        for module in self._modules.values():
            module.reset_slot(idx)


__all__ = [
    "ConfigValidationHook",
    "DirectoryRunSource",
    "DiscoveredHook",
    "ForgottenHook",
    "HasRunDirs",
    "LifecycleHook",
    "MultiRunManager",
    "Progress",
    "RunRecord",
    "RunSource",
    "SlotModule",
    "format_validation_errors",
    "is_valid_run_id",
    "validate_run_id",
]
