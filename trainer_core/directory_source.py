"""Runs as `run_*` directories, as in the source documents (`RunSource` for `loraloom worker --runs-dir`).

The pool trains without the service. Each run is a directory under `runs_dir` (contracts.layout):

    run_xxx/control/orch.toml                    the run config (RunConfig as TOML), written by its owner
    run_xxx/control/evicted.txt                  present: the run stops (written by its owner or the pool)
    run_xxx/control/config_validation_error.txt  written by the pool: why orch.toml was rejected
    run_xxx/rollouts/step_N/*.msgpack            rollout batches (msgpack TrainingBatch, the service's
                                                 stored format), then a STABLE marker (`write_rollout_step`)
    run_xxx/broadcast/step_N/                    written by the pool: the PEFT adapter after step N, then STABLE
    run_xxx/checkpoints/step_N/                  written by the pool: its checkpoints (trainer_core.checkpoint)

Rules for writers of a run directory:

- `orch.toml` is replaced atomically (every RunConfig field has a default, so a half-written file that
  happens to parse would be a valid, wrong config). An admitted run keeps its slot, and the config it
  was admitted with, while its directory exists, even when `orch.toml` is missing or unreadable for a
  while; deleting the directory or writing `evicted.txt` stops it.
- A rollout step directory is read once its STABLE marker exists, and never again; steps are read in
  ascending order, so write them in that order (a step that turns stable below one already read is
  ignored, with a warning). Inside a step, batches are trained in file-name order.

The pool's progress on a run is its newest stable checkpoint; the pool always checkpoints a run's
last step, so a run whose checkpoint reached `max_steps` is complete and is not trained again.
Exactly-once across a restart of the pool: a run resumes from its newest checkpoint and its rollout
files are read again from the start, every sample before the checkpoint's `total_samples` skipped.
"""

import dataclasses
import logging
import re
import shutil
import tomllib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from contracts.arrays import array_batch_decoder, to_lists
from contracts.durable import atomic_replace_dir, atomic_write_bytes, atomic_write_text, beside, fsync_path
from contracts.ids import is_valid_run_id, validate_run_id
from contracts.layout import (
    ADAPTER_FILES,
    BROADCAST_DIR,
    CHECKPOINTS_DIR,
    CONFIG_ERROR_FILE,
    CONTROL_DIR,
    EVICTED_FILE,
    ORCH_CONFIG_FILE,
    ROLLOUTS_DIR,
    STABLE_MARKER,
    step_dir_name,
)
from contracts.pool_api import (
    AckItem,
    CheckpointReport,
    ClaimedBatchStruct,
    InitFrom,
    PoolRegister,
    StepReport,
)
from contracts.progress import Progress
from contracts.wire import TrainingBatch, batch_msgpack_decoder, batch_problems, msgpack_encoder
from trainer_core.checkpoint import checkpoint_progress, latest_checkpoint
from trainer_core.critic import VALUE_HEAD_FILE
from trainer_core.runs import RunRecord

log = logging.getLogger("loraloom.worker")

ROLLOUT_SUFFIX = ".msgpack"
"""Rollout batch files, as the service names its stored payloads."""

_STEP_DIR = re.compile(r"step_(\d+)")

_Signature = tuple[int, int, int]


def write_rollout_step(run_dir: Path, step: int, batches: Sequence[TrainingBatch]) -> Path:
    """Write one rollout step of a run for the pool to read: each batch atomically, then STABLE.

    For orchestrators (and tests) that feed a directory pool. A step is written once: adding to a
    step the pool may have read already would be trained out of order, so that is refused.
    """
    step_dir = Path(run_dir) / ROLLOUTS_DIR / step_dir_name(step)
    if (step_dir / STABLE_MARKER).exists():
        raise FileExistsError(f"{step_dir} is already complete (STABLE); write the next step instead")
    for k, batch in enumerate(batches):
        atomic_write_bytes(step_dir / f"batch_{k:06d}{ROLLOUT_SUFFIX}", msgpack_encoder.encode(batch))
    atomic_write_text(step_dir / STABLE_MARKER, f"{step}\n")
    return step_dir


@dataclass
class _RunFeed:
    """How far the pool has read one admitted run's rollouts."""

    resume_samples: int
    """Samples trained before the checkpoint the run resumed from: they are not handed out again."""
    next_offset: int = 0
    """Index (among all the run's samples) of the next batch's first sample."""
    last_step: int = -1
    """The highest rollout step read."""
    files: deque[tuple[int, Path]] = field(default_factory=deque)
    """Batches of the steps read, not handed out yet: (rollout step, file)."""
    known_steps: set[int] = field(default_factory=set)
    """Steps read, and steps that turned stable after a later one was read (ignored, warned about once)."""


class DirectoryRunSource:
    """`RunSource` over `run_*` directories under `runs_dir` (the module docstring has the layout)."""

    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = Path(runs_dir)
        # run_id -> (stat signature of orch.toml, parsed dict or None on a syntax error). Re-parsing
        # every file on every trainer step would be wasted work, and a syntax error is reported
        # once per version of the file, not once per step.
        self._parsed: dict[str, tuple[_Signature, dict[str, Any] | None]] = {}
        self._warned_names: set[str] = set()
        self._progress: dict[str, tuple[Path, Progress]] = {}
        """run_id -> (its newest checkpoint, the progress recorded in it)."""
        self._feeds: dict[str, _RunFeed] = {}
        self._next_batch_id = 1
        self._seq_len: int | None = None
        self._vocab_size: int | None = None

    lost = False
    """A directory never disowns the pool."""

    def open(self, capabilities: PoolRegister) -> None:
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self._seq_len, self._vocab_size = capabilities.max_seq_len, capabilities.vocab_size
        log.info("training the runs under %s (%d slots)", self.runs_dir, capabilities.slots)

    def close(self) -> None:
        return None

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / validate_run_id(run_id)

    def control_dir(self, run_id: str) -> Path:
        return self.run_dir(run_id) / CONTROL_DIR

    # -- runs ------------------------------------------------------------------------------------

    def list_runs(self) -> list[RunRecord]:
        """Every run directory without `evicted.txt`, sorted by name (within one scan there is no
        reliable creation order: a directory's mtime moves whenever a child changes; the manager
        keeps first-seen order across scans)."""
        if not self.runs_dir.is_dir():
            return []
        records: list[RunRecord] = []
        parsed: dict[str, tuple[_Signature, dict[str, Any] | None]] = {}
        for entry in sorted(self.runs_dir.iterdir(), key=lambda p: p.name):
            name = entry.name
            if not self._is_run_dir(entry) or (entry / CONTROL_DIR / EVICTED_FILE).exists():
                continue
            raw = self._read_config(name, entry / CONTROL_DIR / ORCH_CONFIG_FILE, parsed)
            records.append(RunRecord(run_id=name, raw_config=raw, progress=self._checkpointed(entry)))
        self._parsed = parsed  # forget runs that are gone or evicted
        return records

    def _is_run_dir(self, entry: Path) -> bool:
        if not entry.name.startswith("run_") or not entry.is_dir():
            return False
        if not is_valid_run_id(entry.name):
            if entry.name not in self._warned_names:
                self._warned_names.add(entry.name)
                log.warning("ignoring run directory %r: not a valid run id", entry.name)
            return False
        return True

    def _read_config(
        self, name: str, orch: Path, parsed: dict[str, tuple[_Signature, dict[str, Any] | None]]
    ) -> dict[str, Any] | None:
        """The parsed orch.toml; None when it is missing (not ready yet, or being replaced) or broken."""
        try:
            st = orch.stat()
        except FileNotFoundError:
            return None
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        cached = self._parsed.get(name)
        if cached is not None and cached[0] == signature:
            parsed[name] = cached
            return cached[1]
        try:
            raw: dict[str, Any] | None = tomllib.loads(orch.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None  # deleted between stat and read
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raw = None
            message = f"control/{ORCH_CONFIG_FILE} is not valid TOML: {exc}"
            log.warning("run %s: %s", name, message)
            self.report_invalid_config(name, message)
        parsed[name] = (signature, raw)
        return raw

    def _checkpointed(self, run_dir: Path) -> Progress:
        """The run's progress as of its newest stable checkpoint (zero without one)."""
        path = latest_checkpoint(run_dir / CHECKPOINTS_DIR)
        if path is None:
            return Progress()
        cached = self._progress.get(run_dir.name)
        if cached is None or cached[0] != path:
            cached = self._progress[run_dir.name] = (path, checkpoint_progress(path))
        return dataclasses.replace(cached[1])  # the caller may keep it; the cache stays ours

    def evict(self, run_id: str, reason: str) -> None:
        control = self.control_dir(run_id)
        if not control.parent.is_dir():
            # Deleting the directory already stopped the run; recreating it would leave a ghost.
            log.warning("not evicting run %s: its directory %s is gone", run_id, control.parent)
            return
        control.mkdir(exist_ok=True)
        atomic_write_text(control / EVICTED_FILE, reason)
        self._feeds.pop(run_id, None)

    def fail(self, run_id: str, reason: str) -> None:
        """Run directories know no `failed` state but a config error, which leaves the run listed
        (until its config changes): an eviction, which stops it, with the reason."""
        self.evict(run_id, reason)

    def report_invalid_config(self, run_id: str, message: str) -> None:
        control = self.control_dir(run_id)
        if not control.is_dir():
            log.warning("cannot report the invalid config of run %s: %s is gone", run_id, control)
            return
        atomic_write_text(control / CONFIG_ERROR_FILE, message.rstrip("\n") + "\n")

    def clear_invalid_config(self, run_id: str) -> None:
        (self.control_dir(run_id) / CONFIG_ERROR_FILE).unlink(missing_ok=True)

    # -- batches ---------------------------------------------------------------------------------

    def restart_run(self, run_id: str, progress: Progress) -> None:
        """Read the run's rollouts from the start again, skipping the samples its checkpoint trained."""
        self._feeds[run_id] = _RunFeed(resume_samples=progress.total_samples)

    def release_run(self, run_id: str) -> None:
        self._feeds.pop(run_id, None)

    def init_from(self, run_id: str) -> InitFrom | None:
        return None

    def fetch_init_adapter(self, run_id: str, dest: Path) -> bool:
        """Run directories have no `init_from` (a run starts from its own checkpoint or fresh)."""
        return False

    def claim(self, max_batches: int, run_ids: list[str] | None = None) -> list[ClaimedBatchStruct]:
        """Up to `max_batches` batches of the admitted runs (those `run_ids` names; None: all), one run
        after the other (round robin)."""
        out: list[ClaimedBatchStruct] = []
        turn = [run_id for run_id in self._feeds if run_ids is None or run_id in run_ids]
        while turn and len(out) < max_batches:
            still = []
            for run_id in turn:
                if len(out) == max_batches:
                    break
                batch = self._next_batch(run_id)
                if batch is not None:
                    out.append(batch)
                    still.append(run_id)
            turn = still
        return out

    def ack(self, acks: list[AckItem]) -> None:
        return None  # the run's checkpoints are the record of what was trained

    def _next_batch(self, run_id: str) -> ClaimedBatchStruct | None:
        feed = self._feeds.get(run_id)
        while feed is not None:
            if not feed.files and not self._read_next_step(run_id, feed):
                return None
            step, path = feed.files.popleft()
            batch = self._load(run_id, step, path)
            if batch is None:
                return None  # the run was evicted for it
            offset, n = feed.next_offset, len(batch.examples)
            feed.next_offset += n
            if offset + n <= feed.resume_samples:
                continue  # trained before the checkpoint the run resumed from
            self._next_batch_id += 1
            return ClaimedBatchStruct(
                id=self._next_batch_id - 1,
                run_id=run_id,
                slot=None,
                sample_offset=offset,
                num_samples=n,
                rollout_step=step,
                payload=batch,
            )
        return None

    def _read_next_step(self, run_id: str, feed: _RunFeed) -> bool:
        """Queue the files of the lowest stable rollout step above the last one read; False if none."""
        rollouts = self.run_dir(run_id) / ROLLOUTS_DIR
        stable: list[int] = []
        if rollouts.is_dir():
            for entry in rollouts.iterdir():
                m = _STEP_DIR.fullmatch(entry.name)
                if m and (entry / STABLE_MARKER).is_file():
                    stable.append(int(m.group(1)))
        late = sorted(s for s in stable if s < feed.last_step and s not in feed.known_steps)
        if late:
            feed.known_steps.update(late)
            log.warning(
                "run %s: rollout steps %s turned stable after step %d was read; they are not trained",
                run_id,
                late,
                feed.last_step,
            )
        upcoming = sorted(s for s in stable if s > feed.last_step)
        if not upcoming:
            return False
        step = upcoming[0]
        step_dir = rollouts / step_dir_name(step)
        files = sorted(
            p for p in step_dir.iterdir() if p.suffix == ROLLOUT_SUFFIX and not p.name.startswith(".")
        )
        feed.files.extend((step, p) for p in files)
        feed.last_step = step
        feed.known_steps.add(step)
        return True

    def _load(self, run_id: str, step: int, path: Path) -> TrainingBatch | None:
        """The batch in `path`, checked as the service checks a batch before storing it; a file that
        is not a trainable batch evicts the run, with a reason that names the file and the problem."""
        where = f"{ROLLOUTS_DIR}/{step_dir_name(step)}/{path.name}"
        try:
            data = path.read_bytes()
            try:
                batch = batch_msgpack_decoder.decode(data)
            except msgspec.ValidationError:  # the binary form (a service's stored payload)
                batch = to_lists(array_batch_decoder.decode(data))
        except (OSError, ValueError, msgspec.MsgspecError) as exc:
            self.evict(run_id, f"{where} is not a msgpack TrainingBatch: {exc}")
            return None
        assert self._seq_len is not None, "open() the source first"
        problems = batch_problems(batch, seq_len=self._seq_len, vocab_size=self._vocab_size)
        if problems:
            shown = "; ".join(
                f"{'batch' if p.sample is None else f'sample {p.sample}'}: {p.field}: {p.problem}"
                for p in problems[:5]
            )
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            self.evict(run_id, f"{where} cannot be trained: {shown}{more}")
            return None
        return batch

    # -- results ---------------------------------------------------------------------------------

    def publish_adapter(self, run_id: str, step: int, adapter_dir: Path) -> None:
        """`broadcast/step_N/`: the adapter files, the directory replaced atomically, then STABLE."""
        run_dir = self.run_dir(run_id)
        if not run_dir.is_dir():
            log.warning("not publishing step %d of run %s: its directory is gone", step, run_id)
            return
        broadcast = run_dir / BROADCAST_DIR
        broadcast.mkdir(exist_ok=True)
        staging = beside(broadcast / step_dir_name(step))
        staging.mkdir()
        try:
            # A GAE run's critic (value_head.safetensors) travels with its adapter.
            extra = [VALUE_HEAD_FILE] if (adapter_dir / VALUE_HEAD_FILE).is_file() else []
            for name in [*ADAPTER_FILES, *extra]:
                shutil.copyfile(adapter_dir / name, staging / name)
                fsync_path(staging / name)
            fsync_path(staging)
            final = broadcast / step_dir_name(step)
            atomic_replace_dir(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        atomic_write_text(final / STABLE_MARKER, f"{step}\n")

    def report_checkpoint(self, run_id: str, report: CheckpointReport) -> None:
        return None  # the checkpoint is in the run's own directory already

    def report_step(self, run_id: str, report: StepReport) -> None:
        return None  # the adapter in broadcast/ is the record; the pool logs the step's metrics
