"""Step adapters a run keeps: its newest `Settings.run_adapters_kept` (0: all), the sweeper deleting the
older ones, rows then files (app/sweeper.py). Without a bound, every step's published adapter (a PEFT
directory under `runs/<id>/broadcast/step_N`, its cached tar.gz, its row) stayed until its run was
deleted: a tenant looping Tinker's `optim_step`, or a long RL run, filled the service's disk, which
stops every tenant.

What is kept, and why:
- The newest `run_adapters_kept` steps of each run, so the newest always: what orchestrators download
  (`latest`) and what a client a few steps behind asks for.
- A step a queued or active run starts from (`init_from` {run_id, step}, app/runs/init_from.py). It
  is resolved at the new run's creation but read only when the pool admits that run without a
  checkpoint of its own (GET /v1/pool/runs/{id}/init-adapter), which a restarted pool repeats for an
  active run. A completed, evicted, failed or deleted run is never admitted again: its reference ends.
- A step a live Tinker sampler checkpoint names (`save_weights_for_sampler`: of each path, the newest
  save not deleted, as app.tinker.checkpoints.live_saves resolves it): /api/v1/loraloom/resolve hands
  out its download URL. A name saved again after every step names only its newest save, so it pins
  one step, not all.

Not references: Tinker training states (`save_state`) and `init_from.checkpoint` are the pool's own
files; a sampling session names a step but the pool samples its own copy of it; the dashboard and the
downloads read a step when asked, and a download opens its file before it sends anything
(app/adapters/file_response.py): one under way when its step goes is sent whole.

Races:
- A run created with `init_from` a step while the step is pruned. The pruning takes the admission
  lock, which a run's creation holds from before it resolves the step to its commit
  (app/runs/service.py): either the new run is committed first and pins the step, or the creation
  reads the step after its row went (a 404).
- A step published again (a trainer resumed from an earlier checkpoint) while it is pruned. Its files
  go in a second transaction, under the run's row lock, which the publish holds from the move of its
  files into place to its commit (`store_adapter`): a step that has a row again keeps its new files.
- A sampler save names the step its run was at when the pool ran it, the newest then; the pin starts
  when the pool reports it. With `run_adapters_kept` 1 a step published meanwhile may prune it first;
  the save still samples (the pool's copy), only its download URL is then a pruned 404.

Crash-safe order: the rows are deleted and committed first, then the files go (a file without a row
is harmless, a row without its files a 404 download). The files are renamed into runs/.trash under
the lock and deleted there after the commit (the start-up empties the trash, app/projection.py). A
removal takes every step directory and cached archive of the run no row refers to (an archive of an
earlier publication of its step too), so what a crash (or a download building an archive of a step
as it went) left behind goes at the run's next removal, or at the latest with the sweeper's
reconcile pass (app/adapters/reconcile.py), which also empties trash entries a crash left.

Finding what to prune: the sweeper reads the adapter rows added since its last look (by id, a chunk
at a time; `AdapterScan`) and prunes their runs, so a sweep costs what was published since the last
one. Every RESCAN_SECONDS it reads them all again: a reference that ended (a queued run that left, a
sampler checkpoint deleted) in a run that publishes no more steps is then pruned too; in a run that
does, its next step prunes it. A row committed after the scan passed its id (ids are taken before
the commit) is looked at with its run's next step, or at the rescan.

A download of a pruned step is a 404 `adapter_not_found` saying so (`service.get_adapter`).
"""

import logging
import os
import uuid
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import ColumnElement, Select, exists, func, select
from sqlalchemy.orm import Session

from app.adapters.models import Adapter
from app.adapters.service import ARCHIVE_CACHE_DIR, archive_of, newest_kept_floor
from app.config import Settings
from app.events.after_commit import call_after_commit
from app.projection import TRASH_DIR, empty_trash, names_in, run_dir
from app.retention import PURGE_CHUNK, delete_some
from app.runs.admission import lock_admission
from app.runs.models import Run
from app.tinker.checkpoints import newest_saves_only, saved_path
from app.tinker.models import CHECKPOINT_DELETED, TinkerFuture
from contracts.layout import BROADCAST_DIR, step_of_dir_name
from contracts.status import MOVABLE_RUN_STATUSES, RunStatus

log = logging.getLogger(__name__)

RESCAN_SECONDS = 3600.0
"""How often the scan starts again from the first adapter row (see the module's docstring)."""


@dataclass
class AdapterScan:
    """How far the sweeper has read the adapters table; it keeps one between sweeps."""

    after_id: int = 0
    """The rows up to this id were looked at."""
    started_at: datetime | None = None
    """When the pass from the first row began (None: none yet)."""
    caught_up: bool = False
    """The pass reached the newest row."""

    def begin(self, now: datetime) -> None:
        """A new pass from the first row if none began yet, or if the last one caught up and began
        RESCAN_SECONDS ago (one that has not caught up goes on: restarting it would never end it)."""
        due = self.caught_up and self.started_at is not None
        if self.started_at is None or (due and now - self.started_at >= timedelta(seconds=RESCAN_SECONDS)):
            self.after_id, self.started_at, self.caught_up = 0, now, False


@dataclass
class AdaptersPruned:
    """What one chunk of `prune_step_adapters` did."""

    rows: int = 0
    """Adapter rows deleted."""
    runs: list[str] = field(default_factory=list)
    """The runs whose rows were deleted: their files go next (`remove_pruned_files`), once this
    chunk has committed."""
    after_id: int = 0
    """Where the scan stands after this chunk (`AdapterScan.after_id`)."""
    more: bool = False
    """More rows may be due (the sweeper goes on with another chunk)."""


def _beyond(run_id: str, kept: int) -> ColumnElement[bool]:
    """The run's adapters older than its newest `kept`, by step and by publication alike: a run whose
    steps went back (a Tinker `load_state`, a pool resumed from an older checkpoint) publishes low
    step numbers again, and the one it just published must stay (its row's `created_at` is set at
    each publication, the upsert's too). So up to twice `kept` stay while the two orders differ."""
    return (
        (Adapter.run_id == run_id)
        & (Adapter.step < newest_kept_floor(run_id, kept))
        & (Adapter.created_at < newest_kept_floor(run_id, kept, by=Adapter.created_at))
    )


def prune_step_adapters(
    session: Session, *, kept: int, after_id: int, chunk: int = PURGE_CHUNK
) -> AdaptersPruned:
    """One chunk: the runs of up to `chunk` adapter rows past `after_id` lose their adapters older than
    their newest `kept` (0: none), but for those referred to; at most `chunk` rows. Never commits."""
    if kept <= 0:
        return AdaptersPruned(after_id=after_id)
    seen = session.execute(
        select(Adapter.id, Adapter.run_id).where(Adapter.id > after_id).order_by(Adapter.id).limit(chunk)
    ).all()
    if not seen:
        return AdaptersPruned(after_id=after_id)
    end, full = seen[-1].id, len(seen) == chunk
    candidates = sorted({run_id for _, run_id in seen})
    # Read without a lock first: most sweeps find nothing to prune, and take no lock.
    over = [run_id for run_id in candidates if session.scalar(select(exists().where(_beyond(run_id, kept))))]
    if not over:
        return AdaptersPruned(after_id=end, more=full)
    # A run created from one of these steps commits before the references are read, or reads the
    # step after its row went: never a run starting from a step pruned meanwhile.
    lock_admission(session)
    pinned = pinned_steps(session, over)
    budget, pruned = chunk, []
    for run_id in over:
        where = _beyond(run_id, kept) & Adapter.step.not_in(sorted(pinned.get(run_id, ())))
        n = delete_some(session, Adapter.id, where, budget, order_by=Adapter.step)
        if n:
            pruned.append(run_id)
            log.info("retention: pruned %s step adapter(s) of run %s (keeps its newest %s)", n, run_id, kept)
        budget -= n
        if budget == 0:  # these runs may have more: the same rows again next chunk
            return AdaptersPruned(rows=chunk, runs=pruned, after_id=after_id, more=True)
    return AdaptersPruned(rows=chunk - budget, runs=pruned, after_id=end, more=full)


def pinned_steps(session: Session, run_ids: Collection[str]) -> dict[str, set[int]]:
    """The steps of these runs something still refers to, by run: those a queued or active run starts
    from, and those the live sampler checkpoints name (see the module's docstring)."""
    pinned: dict[str, set[int]] = defaultdict(set)
    source = Run.init_from["run_id"].as_string()
    starts = session.execute(
        select(source, Run.init_from["step"].as_integer()).where(
            Run.status.in_(MOVABLE_RUN_STATUSES), source.in_(run_ids)
        )
    )
    for run_id, step in starts:
        if step is not None:  # a start from a checkpoint or an uploaded adapter names no step
            pinned[run_id].add(int(step))
    for run_id, step in session.execute(_live_sampler_steps(run_ids)):
        if run_id is not None and step is not None:
            pinned[run_id].add(int(step))
    return pinned


def _live_sampler_steps(run_ids: Iterable[str]) -> Select[str | None, int | None]:
    """(run, step) of each live sampler checkpoint of these runs: per path, its newest save not
    deleted, ordered as `checkpoints.live_saves` orders them (the one a path resolves to)."""
    saves = (
        select(
            TinkerFuture.run_id,
            TinkerFuture.result["loraloom_step"].as_integer().label("step"),
            func.row_number()
            .over(
                partition_by=saved_path(),
                order_by=(
                    TinkerFuture.seq_id.desc(),
                    TinkerFuture.completed_at.desc(),
                    TinkerFuture.id.desc(),
                ),
            )
            .label("newest"),
        )
        .where(
            TinkerFuture.run_id.in_(list(run_ids)),
            TinkerFuture.kind == "save_weights_for_sampler",
            TinkerFuture.status == "complete",
            TinkerFuture.completed_at.is_not(None),
            saved_path().is_not(None),
            TinkerFuture.result[CHECKPOINT_DELETED].as_string().is_(None),
            newest_saves_only(),  # through the partial index: not every save a path ever had
        )
        .subquery()
    )
    return select(saves.c.run_id, saves.c.step).where(saves.c.newest == 1)


@dataclass(frozen=True)
class StepFile:
    """A step directory, or a step's cached archive, of a run."""

    path: Path
    step: int
    sha256: str | None
    """An archive's: the start of the weights' sha256 its name holds (None: a step directory)."""


def step_files(root: Path) -> list[StepFile]:
    """The step directories (broadcast/) and cached archives (cache/) in the run directory `root`,
    named as the service names them (any other name is not the service's to remove)."""
    files = [
        StepFile(root / BROADCAST_DIR / name, step, None)
        for name in names_in(root / BROADCAST_DIR)
        if (step := step_of_dir_name(name)) is not None
    ]
    return files + [
        StepFile(root / ARCHIVE_CACHE_DIR / name, *archive)
        for name in names_in(root / ARCHIVE_CACHE_DIR)
        if (archive := archive_of(name)) is not None
    ]


def published_steps(session: Session, *, run_id: str) -> dict[int, str]:
    """The run's steps that have a row, with their weights' sha256."""
    rows = session.execute(select(Adapter.step, Adapter.sha256).where(Adapter.run_id == run_id))
    return {step: sha for step, sha in rows}


def unreferenced(files: Iterable[StepFile], published: Mapping[int, str]) -> list[Path]:
    """Of `files`, in step order, those no row refers to: a step without a row, and an archive of an
    earlier publication of its step (another sha256)."""
    doomed = [
        f
        for f in files
        if f.step not in published or (f.sha256 is not None and not published[f.step].startswith(f.sha256))
    ]
    return [f.path for f in sorted(doomed, key=lambda f: f.step)]


def remove_pruned_files(
    session: Session, *, run_id: str, settings: Settings, limit: int | None = None
) -> int:
    """Move the run's step directories and cached archives no row refers to (`unreferenced`; the first
    `limit` by step, None: all) out of the run's directory, under the run's row lock, into
    runs/.trash; they are deleted there once the transaction commits. Returns how many. Never commits."""
    run = session.get(Run, run_id, with_for_update=True, populate_existing=True)
    if run is None or run.status == RunStatus.DELETED:
        return 0  # its directory goes whole (app/projection.py)
    files = step_files(run_dir(settings, run_id))
    doomed = unreferenced(files, published_steps(session, run_id=run_id))[:limit] if files else []
    moved = _trash_after_commit(session, run_id=run_id, paths=doomed, settings=settings)
    if moved:
        log.info("retention: removed the files of %s step adapter(s) of run %s without a row", moved, run_id)
    return moved


def _trash_after_commit(session: Session, *, run_id: str, paths: Iterable[Path], settings: Settings) -> int:
    """Rename `paths` (files or directories of the run) into runs/.trash now, and delete them there
    once the session's transaction commits; the caller holds the run's row lock. Returns how many
    were moved (one gone already, by another sweeper's removal, is skipped). Never commits."""
    trash = settings.runs_dir / TRASH_DIR
    moved: list[Path] = []
    for path in paths:
        if not moved:
            trash.mkdir(parents=True, exist_ok=True)
        target = trash / f"{run_id}.{path.name}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            continue
        moved.append(target)

    def discard() -> None:  # what a failure leaves, the reconcile pass empties
        empty_trash(settings, names=[target.name for target in moved])

    if moved:
        call_after_commit(session, discard)
    return len(moved)
