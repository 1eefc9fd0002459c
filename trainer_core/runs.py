"""Which runs the worker pool trains, in which slot, and how every rank agrees on it.

A `RunSource` reports the runs that should be training (the service over HTTP, `http_source`; or
`run_*` directories as in the source documents, `directory_source`); the `MultiRunManager` turns
those reports into slots 0..max_runs-1 holding validated configs. Life of a run, as seen by the
manager:

    listed by the source ──▶ validated (RunConfig, then the pool's `check`)
        invalid ──▶ source.report_invalid_config(...)   (not admitted; validated again when it changes)
        valid   ──▶ waiting for a slot (oldest seen first) ──▶ admitted to a slot
    admitted ──▶ no longer listed (deleted, evicted), or its progress reached max_steps ──▶ slot freed

Only the master rank (rank 0) talks to the source, in `discover_runs()`. Every rank then calls
`synchronize_state()`, which broadcasts the master's slots and returns the same `SlotChanges` on
every rank (releases first, then admissions, by ascending slot), so that every rank releases and
admits in the same order and collectives inside those stay matched.

There is no module-level state: build one manager and pass it to whoever needs it.
"""

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from pydantic import ValidationError

from contracts.ids import is_valid_run_id
from contracts.pool_api import (
    AckItem,
    CheckpointReport,
    ClaimedBatchStruct,
    InitFrom,
    PoolRegister,
    StepReport,
)
from contracts.progress import Progress
from contracts.run_config import RunConfig
from trainer_core.dist import World, broadcast_from_master

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunRecord:
    """What a source reports about one run that should be training (not evicted)."""

    run_id: str
    raw_config: dict[str, Any] | None
    """The run's config as plain data, validated by the manager. None: no usable config right now
    (not written yet, or unreadable; the source has reported why, if there is a reason). A waiting
    run is not admitted; an admitted run keeps its slot and the config it was admitted with."""
    slot_hint: int | None = None
    """The slot the source wants this run in (the service assigns slots); honoured when free."""
    progress: Progress | None = None
    """How far the run has trained (None: not known); a run at its `max_steps` is complete."""


class RunLister(Protocol):
    """The part of a source that says which runs to train (what `MultiRunManager` needs)."""

    def list_runs(self) -> list[RunRecord]:
        """Every run that should be training now (evicted runs left out), oldest first."""
        ...

    def evict(self, run_id: str, reason: str) -> None:
        """Stop the run for good; it disappears from later `list_runs()` answers."""
        ...

    def fail(self, run_id: str, reason: str) -> None:
        """Stop for good a run the pool cannot start (its `init_from` weights could not be loaded),
        saying why; it disappears from later `list_runs()` answers."""
        ...

    def report_invalid_config(self, run_id: str, message: str) -> None:
        """Tell the run's owner that its config was rejected, and why."""
        ...

    def clear_invalid_config(self, run_id: str) -> None:
        """Withdraw an earlier `report_invalid_config` (the config is valid now)."""
        ...


class RunSource(RunLister, Protocol):
    """Where the master rank learns which runs to train, gets their batches and sends their results:
    the service (`HttpRunSource`) or run directories (`DirectoryRunSource`)."""

    @property
    def lost(self) -> bool:
        """The source no longer accepts this pool's work: the pool stops."""
        ...

    def open(self, capabilities: PoolRegister) -> None:
        """Start serving a pool that can train this (the service registers it)."""
        ...

    def close(self) -> None: ...

    def restart_run(self, run_id: str, progress: Progress) -> None:
        """The pool (re)starts the run at `progress` (its checkpoint): every batch handed out after
        that point is handed out again (exactly-once, docs/contracts.md)."""
        ...

    def release_run(self, run_id: str) -> None:
        """The pool no longer trains the run."""
        ...

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        """Up to `max_batches` rollout batches of the runs the pool trains (of those `run_ids` names;
        None: of any), fair across runs; each run's in order."""
        ...

    def ack(self, acks: list[AckItem]) -> None:
        """These batches were trained by the optimizer step they name."""
        ...

    def publish_adapter(self, run_id: str, step: int, adapter_dir: Path) -> None:
        """The run's PEFT adapter after `step`."""
        ...

    def report_checkpoint(self, run_id: str, report: CheckpointReport) -> None: ...

    def report_step(self, run_id: str, report: StepReport) -> None: ...

    def init_from(self, run_id: str) -> InitFrom | None:
        """Where the run starts from (`init_from`), or None."""
        ...

    def fetch_init_adapter(self, run_id: str, dest: Path) -> bool:
        """Write the PEFT files of the adapter the run starts from (`init_from`) into `dest`; False when
        the run has none."""
        ...


ConfigCheck = Callable[[RunConfig], list[str]]
"""config -> problems beyond the RunConfig schema (e.g. above the pool's maximum rank); [] when it fits."""


def pool_config_problems(
    config: RunConfig, *, base_model: str, max_rank: int, target_modules: tuple[str, ...], seq_len: int
) -> list[str]:
    """What a pool with these capabilities cannot train of `config` (a `ConfigCheck`)."""
    problems = []
    if config.base_model != base_model:
        problems.append(f"base_model: {config.base_model!r}, but this pool trains {base_model!r}")
    if config.lora.rank > max_rank:
        problems.append(f"lora.rank: {config.lora.rank} is above this pool's maximum {max_rank}")
    missing = sorted(set(config.lora.target_modules) - set(target_modules))
    if missing:
        problems.append(
            f"lora.target_modules: {missing} are not adapted by this pool ({list(target_modules)})"
        )
    if config.seq_len > seq_len:
        problems.append(f"seq_len: {config.seq_len} is above this pool's {seq_len}")
    return problems


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


@dataclass(frozen=True)
class SlotChanges:
    """What `synchronize_state()` changed, the same on every rank."""

    released: list[tuple[int, str]] = field(default_factory=list)
    """(slot, run_id) of the runs that left, ascending slot: release these first."""
    admitted: list[tuple[int, str, RunConfig]] = field(default_factory=list)
    """(slot, run_id, config) of the runs that arrived, ascending slot (a slot may be in both lists)."""


@dataclass
class _Candidate:
    """A listed run that has not been admitted: its latest report and validation result."""

    record: RunRecord
    validated: bool = False
    """Whether `validated_raw` holds the raw config of the last validation."""
    validated_raw: dict[str, Any] | None = None
    config: RunConfig | None = None
    """The validated config; None when invalid or not validated."""
    logged: str = ""
    """The last state logged for it ("waiting", "complete"), so each is logged once."""


def _complete(record: RunRecord, config: RunConfig) -> bool:
    return record.progress is not None and record.progress.step >= config.max_steps


class MultiRunManager:
    """Slots and configs of the runs one worker pool trains.

    Loop, on every rank: the master calls `discover_runs()`, then every rank calls
    `synchronize_state()` and applies the changes it returns. Between two `synchronize_state()`
    calls the other ranks see the previous state.
    """

    def __init__(
        self,
        source: RunLister | None,
        max_runs: int,
        *,
        world: World = World(),
        check: ConfigCheck | None = None,
    ) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs}")
        if world.is_master and source is None:
            raise ValueError("the master rank needs a run source")
        self.source = source
        """Only the master polls it; other ranks pass None (only rank 0 talks to the service)."""
        self.max_runs = max_runs
        self.world = world
        self.check = check
        """The pool's own rules for a config (`pool_config_problems`), applied after the schema."""

        self._run_ids: dict[int, str] = {}
        self._slots: dict[str, int] = {}
        self._config: dict[int, RunConfig] = {}
        # slot -> which admission put its run there: a run released and admitted again into the same
        # slot between two synchronisations (`release_run`) is then still a release + an admission.
        self._admission: dict[int, int] = {}
        self._admissions = 0
        # Listed but not admitted, in first-seen order (dicts keep insertion order): that order is
        # the queue for free slots.
        self._candidates: dict[str, _Candidate] = {}
        # The slots as of the last synchronize_state(): every rank diffs against them, so the master
        # (whose maps discover_runs() already changed) computes the same changes as the others.
        self._synced: dict[int, tuple[str, int]] = {}

    # ── read-only views (nobody outside can break the slot <-> run id bijection) ──────────────────

    @property
    def run_ids(self) -> Mapping[int, str]:
        """slot -> run id."""
        return MappingProxyType(self._run_ids)

    @property
    def slots(self) -> Mapping[str, int]:
        """run id -> slot."""
        return MappingProxyType(self._slots)

    @property
    def config(self) -> Mapping[int, RunConfig]:
        return MappingProxyType(self._config)

    @property
    def used_slots(self) -> list[int]:
        """Slots holding a run, ascending (a list, so every rank iterates them in the same order)."""
        return sorted(self._run_ids)

    @property
    def free_slots(self) -> list[int]:
        return [s for s in range(self.max_runs) if s not in self._run_ids]

    @property
    def waiting_run_ids(self) -> list[str]:
        """Runs with a valid config waiting for a free slot, oldest seen first (master only)."""
        return [rid for rid, c in self._candidates.items() if self._admissible(c)]

    # ── master: discovery and eviction ──────────────────────────────────────────────────────────

    def _require_master(self, what: str) -> RunLister:
        if not self.world.is_master or self.source is None:
            raise RuntimeError(f"{what} runs on the master rank only (this is rank {self.world.rank})")
        return self.source

    def discover_runs(self) -> None:
        """Poll the source and update the master's view (master only): forget the runs that left,
        validate new and changed ones, admit valid ones into free slots."""
        records = self._listed(self._require_master("discover_runs()"))
        for slot, rid in sorted(self._run_ids.items()):
            record = records.get(rid)
            if record is None or _complete(record, self._config[slot]):
                self._forget(slot)
                logger.info(
                    "run %s left slot %d (%s)", rid, slot, "not listed" if record is None else "complete"
                )
        for rid in [rid for rid in self._candidates if rid not in records]:
            del self._candidates[rid]
        for rid, record in records.items():
            if rid not in self._slots:  # admitted runs keep the config they were admitted with
                candidate = self._candidates.setdefault(rid, _Candidate(record=record))
                candidate.record = record
                self._validate(candidate)
        self._admit()

    def _listed(self, source: RunLister) -> dict[str, RunRecord]:
        records: dict[str, RunRecord] = {}
        for record in source.list_runs():
            if not is_valid_run_id(record.run_id):
                logger.warning("ignoring run %r from the source: not a valid run id", record.run_id)
            elif record.run_id in records:
                logger.warning("run %s listed twice by the source; keeping the first", record.run_id)
            else:
                records[record.run_id] = record
        return records

    def _validate(self, candidate: _Candidate) -> None:
        source = self._require_master("validation")
        rid, raw = candidate.record.run_id, candidate.record.raw_config
        if raw is None:
            # Not ready, or unreadable (the source reported why): validate afresh once it is back.
            candidate.validated, candidate.validated_raw, candidate.config = False, None, None
            return
        if candidate.validated and raw == candidate.validated_raw:
            return  # unchanged since the last verdict: do not re-report every step
        candidate.validated, candidate.validated_raw, candidate.config = True, raw, None
        config, problems = self._config_problems(rid, raw)
        if problems:
            text = f"Invalid config for run {rid} ({len(problems)} problem{'s' * (len(problems) > 1)}):\n"
            text += "".join(f"- {p}\n" for p in problems)
            logger.warning("%s", text.rstrip())
            source.report_invalid_config(rid, text)
            return
        candidate.config = config
        source.clear_invalid_config(rid)

    def _config_problems(self, rid: str, raw: dict[str, Any]) -> tuple[RunConfig | None, list[str]]:
        try:
            config = RunConfig.model_validate(raw)
        except ValidationError as exc:
            return None, format_validation_errors(exc)
        if self.check is None:
            return config, []
        try:
            return config, list(self.check(config))
        except Exception as exc:  # a config must not be able to crash the pool through the check
            logger.exception("the config check raised on run %s", rid)
            return config, [f"the pool's config check failed: {exc!r}"]

    def _admissible(self, c: _Candidate) -> bool:
        return c.config is not None and not _complete(c.record, c.config)

    def _admit(self) -> None:
        for c in self._candidates.values():
            if c.config is not None and not self._admissible(c) and c.logged != "complete":
                c.logged = "complete"
                logger.info(
                    "run %s has completed its %d steps: not training it", c.record.run_id, c.config.max_steps
                )
        for slot, c in self._choose_slots([c for c in self._candidates.values() if self._admissible(c)]):
            assert c.config is not None
            del self._candidates[c.record.run_id]
            self._remember(slot, c.record.run_id, c.config)
            logger.info("run %s admitted to slot %d", c.record.run_id, slot)

    def _choose_slots(self, ready: list[_Candidate]) -> list[tuple[int, _Candidate]]:
        """Free slots for the `ready` runs (first seen first), hinted slots before the others."""
        free = set(self.free_slots)
        # Hints first: the service owns slot assignment, and a run taking the lowest free slot must
        # not push a hinted run out of the slot the service gave it.
        chosen: list[tuple[int, _Candidate]] = []
        for c in ready:
            hint = c.record.slot_hint
            if hint is not None and hint in free:
                free.discard(hint)
                chosen.append((hint, c))
        hinted = {c.record.run_id for _, c in chosen}
        for c in ready:
            if c.record.run_id in hinted:
                continue
            if not free:
                if c.logged != "waiting":
                    c.logged = "waiting"
                    logger.info("run %s waits for a free slot (max_runs=%d)", c.record.run_id, self.max_runs)
                continue
            hint = c.record.slot_hint
            if hint is not None:
                logger.warning(
                    "run %s: slot hint %d is %s; using the lowest free slot",
                    c.record.run_id,
                    hint,
                    "taken" if 0 <= hint < self.max_runs else "out of range",
                )
            slot = min(free)
            free.discard(slot)
            chosen.append((slot, c))
        return chosen

    def evict_run(self, slot: int, reason: str) -> None:
        """Stop the run in `slot` for good (master only). It stays in its slot until the next
        `discover_runs()` no longer sees it, as in the source documents."""
        source, run_id = self._master_and_run("evict_run()", slot)
        source.evict(run_id, reason)
        logger.warning("evicted run %s (slot %d): %s", run_id, slot, reason)

    def fail_run(self, slot: int, reason: str) -> None:
        """Stop for good the run in `slot`, which the pool cannot start (master only); it stays in its
        slot until the next `discover_runs()` no longer sees it, as an evicted run."""
        source, run_id = self._master_and_run("fail_run()", slot)
        source.fail(run_id, reason)
        logger.warning("failed run %s (slot %d): %s", run_id, slot, reason)

    def _master_and_run(self, what: str, slot: int) -> tuple[RunLister, str]:
        """The run source (master only) and the id of the run in `slot` (KeyError if none)."""
        source = self._require_master(what)
        if slot not in self._run_ids:
            raise KeyError(f"no run in slot {slot}")
        return source, self._run_ids[slot]

    def release_run(self, slot: int, reason: str) -> None:
        """Free `slot` now, whatever the source lists (master only): the pool's answer to a run that
        left mid-step (`trainer_core.run_left`). Every rank releases it at the next
        `synchronize_state()`; should the source still list the run, it is admitted afresh (from its
        checkpoint) like any new run."""
        self._require_master("release_run()")
        if slot not in self._run_ids:
            raise KeyError(f"no run in slot {slot}")
        logger.info("run %s released from slot %d: %s", self._run_ids[slot], slot, reason)
        self._forget(slot)

    # ── every rank ──────────────────────────────────────────────────────────────────────────────

    def synchronize_state(self) -> SlotChanges:
        """Make every rank's slots equal to the master's and return what changed since the last call:
        the same releases and admissions on every rank. A slot whose run changed is released and
        admitted. Collective: every rank must call it."""
        state = broadcast_from_master(
            {slot: (rid, self._config[slot], self._admission[slot]) for slot, rid in self._run_ids.items()}
            if self.world.is_master
            else None,
            self.world,
        )
        if not self.world.is_master:
            for slot in list(self._run_ids):
                self._forget(slot)
            for slot, (rid, config, admission) in sorted(state.items()):
                self._remember(slot, rid, config, admission=admission)
        previous = self._synced
        current = {slot: (rid, self._admission[slot]) for slot, rid in self._run_ids.items()}
        self._synced = current
        return SlotChanges(
            released=[(s, rid) for s, (rid, n) in sorted(previous.items()) if current.get(s) != (rid, n)],
            admitted=[
                (s, rid, self._config[s])
                for s, (rid, n) in sorted(current.items())
                if previous.get(s) != (rid, n)
            ],
        )

    def _remember(self, slot: int, run_id: str, config: RunConfig, *, admission: int | None = None) -> None:
        if admission is None:
            self._admissions += 1
            admission = self._admissions
        self._run_ids[slot] = run_id
        self._slots[run_id] = slot
        self._config[slot] = config
        self._admission[slot] = admission

    def _forget(self, slot: int) -> None:
        run_id = self._run_ids.pop(slot)
        del self._slots[run_id]
        del self._config[slot]
        del self._admission[slot]


__all__ = [
    "ConfigCheck",
    "MultiRunManager",
    "RunLister",
    "RunRecord",
    "RunSource",
    "SlotChanges",
    "format_validation_errors",
    "pool_config_problems",
]
