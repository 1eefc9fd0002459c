"""Adapter files no row refers to, and trash a removal left, deleted: the sweeper's reconcile pass.

Every way an adapter reaches the disk orders its files and its row so that a crash leaves at worst
files without a row, never a row without its files (a 404 download). Those files take disk until
something removes them, and before this pass little did:
- a run's step directory (`broadcast/step_N`) or cached archive (`cache/adapter_step_N_<sha>.tar.gz`)
  whose row a pruning deleted before a crash cut the files' removal short (app/adapters/pruning.py),
  or which a publish moved into place before a commit that never came (`service.store_adapter`);
- a publish's staging directory (`broadcast/.step_N.<hex>.tmp`), a step's replaced copy (`.old`),
  an archive's temporary (`cache/.adapter_step_….tmp`): names `contracts.durable.beside` makes;
- an uploaded adapter's directory without a row, an upload's staging directory (`adapters/.upload_…`);
- entries of `runs/.trash` whose deletion was cut short.
Every service process runs the pass (DESIGN §10: replicas on a shared volume; each job is safe
against another process's), so one process's leftovers go without waiting for it to restart. Only
names the service writes are looked at (`step_of_dir_name`, `archive_of`, `final_name_of`,
`is_upload_dir_name`): `step_007` or a step past INT32_MAX is none of ours, and is left alone.

Never what is in flight:
- A step directory moves into place under its run's row lock, and its row follows in that
  transaction. The files no row refers to go through `remove_pruned_files`, which reads the rows
  again under that lock (a publish that moved its files in meanwhile has committed its row by then)
  and moves them into the trash, deleted after the commit. A first look without the lock skips the
  runs with nothing to remove; on Postgres it takes no lock, on SQLite its transaction begins, as
  every one there does, with BEGIN IMMEDIATE (app/db.py): the write lock, for one short read.
- A staging directory or a temporary is written outside any lock, and its name says nothing of its
  state: it goes once untouched for ORPHAN_GRACE_SECONDS (`durable.untouched`). A body has arrived
  whole before it is unpacked (its route spools it first), so a write there runs at disk speed: an
  hour is far above it.
- An uploaded adapter's directory is held by its upload with a flock until the upload's transaction
  ends: it goes when idle past the grace, without a row, and `uploads.remove_if_unheld` finds its
  flock free and, asked again, still no row. The grace also guards file systems whose flocks other
  machines do not see.
- A trash entry is doomed whatever happens; one idle past the grace goes, so a removal under way is
  left to its owner.

Bounded: a sweep gives the pass BUDGET_SECONDS, checked between entries (the sweep's other jobs,
lease expiry and pool liveness among them, wait for it), and pages of RUN_PAGE runs, PAGE names of
the uploads' directory and TRASH_PAGE trash entries; cursors kept between sweeps carry the pass on.
Each part (runs, uploads, trash) fails alone: its cursor stays, and the next sweep reads its page
again. An entry that fails is logged and passed over until the next pass: one that keeps failing (a
directory the service may not delete) must not hold back every entry after it. A pass begins at the
sweeper's first sweep (so a start-up reconciles what a crash left), and again RECONCILE_SECONDS after
the last one began, once it caught up.
"""

import heapq
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from app.adapters.models import TenantAdapter
from app.adapters.pruning import published_steps, remove_pruned_files, step_files, unreferenced
from app.adapters.service import ARCHIVE_CACHE_DIR, archive_of
from app.adapters.uploads import is_upload_dir_name, remove_if_unheld, uploads_dir
from app.config import Settings
from app.projection import TRASH_DIR, empty_trash, names_in, remove_tree, run_dir
from app.runs.models import Run
from contracts.durable import final_name_of, untouched
from contracts.layout import BROADCAST_DIR, step_of_dir_name
from contracts.status import RunStatus

log = logging.getLogger(__name__)

ORPHAN_GRACE_SECONDS = 3600.0
"""How long a staging directory, a temporary file, an uploaded adapter's directory without a row or
a trash entry must have been untouched before it goes (see the module's docstring)."""
RECONCILE_SECONDS = 3600.0
"""How often a pass begins again (once the last one caught up)."""
BUDGET_SECONDS = 1.0
"""The time a sweep gives the pass, checked between entries (one begun is finished)."""
RUN_PAGE = 100
"""Runs a sweep looks at, at most."""
PAGE = 500
"""Names of the uploads' directory a sweep looks at, at most."""
TRASH_PAGE = 50
"""Trash entries a sweep looks at, at most (each may be a deleted run's whole directory)."""
STEPS_A_RUN = 100
"""Step directories and archives one transaction moves out of a run's directory; more go at the
next pass."""


@dataclass
class Cursor:
    """Where one part of the pass stands."""

    after: str = ""
    """The names up to this one were looked at."""
    done: bool = False

    def next(self, names: Iterable[str], size: int) -> list[str]:
        """The first `size` of `names` past the cursor, sorted, and one more if there is (the page is
        then not the last)."""
        return heapq.nsmallest(size + 1, (name for name in names if name > self.after))


@dataclass
class ReconcileScan:
    """Where the reconcile pass stands; the sweeper keeps one between sweeps."""

    started_at: datetime | None = None
    """When the pass began (None: none yet)."""
    runs: Cursor = field(default_factory=Cursor)
    uploads: Cursor = field(default_factory=Cursor)
    trash: Cursor = field(default_factory=Cursor)

    @property
    def caught_up(self) -> bool:
        return self.runs.done and self.uploads.done and self.trash.done

    def begin(self, now: datetime) -> bool:
        """Whether this sweep reconciles: a pass under way goes on; a new one begins at the first
        sweep, and once the last one caught up and began RECONCILE_SECONDS ago."""
        due = self.started_at is None or (
            self.caught_up and now - self.started_at >= timedelta(seconds=RECONCILE_SECONDS)
        )
        if due:
            self.started_at, self.runs, self.uploads, self.trash = now, Cursor(), Cursor(), Cursor()
        return not self.caught_up


@dataclass
class Reconciled:
    """What one sweep's share of the pass removed (this process, not another one meanwhile)."""

    run_files: int = 0
    """Step directories and cached archives no row refers to, staging leftovers and temporaries."""
    uploads: int = 0
    """Uploaded adapters' directories without a row, and upload staging leftovers."""
    trash_entries: int = 0
    """Entries of runs/.trash a removal left."""
    failed: list[str] = field(default_factory=list)
    """What failed, logged with its traceback: a part (`runs`, `uploads`, `trash`), or one run, one
    name of the uploads' directory or one trash entry."""


def reconcile_adapter_files(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    scan: ReconcileScan,
    now: datetime,
    clock: Callable[[], float] = time.monotonic,
) -> Reconciled:
    """This sweep's share of the pass `scan` stands in (none between passes): the next pages of runs,
    of uploads and of the trash, within BUDGET_SECONDS of `clock`. Each database read or change is
    a short transaction of its own."""
    done = Reconciled()
    if not scan.begin(now):
        return done
    deadline = clock() + BUDGET_SECONDS
    sweep = _Sweep(
        factory, settings, now.timestamp() - ORPHAN_GRACE_SECONDS, lambda: clock() >= deadline, done
    )
    for part, cursor, work in (
        ("runs", scan.runs, sweep.runs),
        ("uploads", scan.uploads, sweep.uploads),
        ("trash", scan.trash, sweep.trash),
    ):
        if cursor.done:
            continue
        try:
            work(cursor)
        except Exception:
            log.exception("reconcile: the %s part failed; the next sweep reads its page again", part)
            done.failed.append(part)
    if done.run_files or done.uploads or done.trash_entries:
        log.info(
            "reconcile: removed %s run files, %s upload directories and %s trash entries no row refers to",
            done.run_files,
            done.uploads,
            done.trash_entries,
        )
    return done


@dataclass
class _Sweep:
    factory: sessionmaker[Session]
    settings: Settings
    cutoff: float
    """Seconds since the epoch: what was touched later is within the grace."""
    out_of_time: Callable[[], bool]
    done: Reconciled

    def runs(self, cursor: Cursor) -> None:
        with self.factory() as session:
            page = list(
                session.scalars(
                    select(Run.id)
                    .where(Run.id > cursor.after, Run.status != RunStatus.DELETED)
                    .order_by(Run.id)
                    .limit(RUN_PAGE + 1)
                )
            )

        def one(run_id: str) -> None:
            self.done.run_files += reconcile_run(
                self.factory, run_id=run_id, settings=self.settings, cutoff=self.cutoff
            )

        self._walk(cursor, page, RUN_PAGE, one)

    def uploads(self, cursor: Cursor) -> None:
        root = uploads_dir(self.settings)
        page = cursor.next(filter(is_upload_dir_name, names_in(root)), PAGE)
        with self.factory() as session:
            kept = set(session.scalars(select(TenantAdapter.id).where(TenantAdapter.id.in_(page))))

        def one(name: str) -> None:
            if name not in kept and untouched(root / name, since=self.cutoff):
                with self.factory() as session:
                    self.done.uploads += remove_if_unheld(session, root / name)

        self._walk(cursor, page, PAGE, one)

    def trash(self, cursor: Cursor) -> None:
        page = cursor.next(names_in(self.settings.runs_dir / TRASH_DIR), TRASH_PAGE)

        def one(name: str) -> None:
            self.done.trash_entries += empty_trash(self.settings, names=[name], untouched_since=self.cutoff)

        self._walk(cursor, page, TRASH_PAGE, one)

    def _walk(self, cursor: Cursor, page: list[str], size: int, one: Callable[[str], None]) -> None:
        """`one` on each of the first `size` names of `page` (sorted, past the cursor) while the
        sweep's time lasts, the cursor following; one that fails is logged and passed over."""
        for name in page[:size]:
            if self.out_of_time():
                return
            try:
                one(name)
            except Exception:
                log.exception("reconcile: %s failed; the next pass tries again", name)
                self.done.failed.append(name)
            cursor.after = name
        cursor.done = len(page) <= size


def reconcile_run(factory: sessionmaker[Session], *, run_id: str, settings: Settings, cutoff: float) -> int:
    """Remove the run's step directories and cached archives no row refers to, and its staging
    leftovers and temporaries untouched since `cutoff` (seconds since the epoch). Returns how many
    this call removed."""
    root = run_dir(settings, run_id)
    removed = sum(remove_tree(path) for path in _temporaries(root) if untouched(path, since=cutoff))
    files = step_files(root)
    if not files:
        return removed
    with factory() as session:  # the first look, without the run's lock (see the module's docstring)
        published = published_steps(session, run_id=run_id)
    if unreferenced(files, published):
        with factory() as session:
            removed += remove_pruned_files(session, run_id=run_id, settings=settings, limit=STEPS_A_RUN)
            session.commit()
    return removed


def _temporaries(root: Path) -> list[Path]:
    """A publish's staging directories and a step's replaced copies under broadcast/, and archives'
    temporaries under cache/, in the run directory `root`."""
    beside_what = ((BROADCAST_DIR, step_of_dir_name), (ARCHIVE_CACHE_DIR, archive_of))
    return [
        root / folder / name
        for folder, final_name in beside_what
        for name in names_in(root / folder)
        if (final := final_name_of(name)) is not None and final_name(final) is not None
    ]
