"""Adapter files no row refers to, and trash a removal left, deleted: the sweeper's reconcile pass.

Every way an adapter reaches the disk orders its files and its row so that a crash leaves at worst
files without a row, never a row without its files (a 404 download). Those files are harmless, but
they take disk until something removes them, and before this pass little did:
- a run's step adapter (`broadcast/step_N`, its cached `cache/adapter_step_N_<sha>.tar.gz`) whose
  row a pruning deleted and committed before the crash cut the files' removal short
  (app/adapters/pruning.py), or which a publish moved into place before a commit that never came
  (`service.store_adapter`): gone only at the run's next pruning, or its deletion;
- the staging directory of a publish cut short (`broadcast/.step_N.<hex>.tmp`), the old copy of a
  step published again (`.step_N.<hex>.old`, contracts.durable.atomic_replace_dir): nothing
  removed them (the start-up's `remove_stale_temporaries` removes temporary files, not directories);
  an archive's temporary file (`cache/.adapter_step_….tmp`);
- an uploaded adapter (`adapters/adp_…`) moved into place before a commit that never came, and an
  upload's staging directory (`adapters/.upload_…`): gone only at a start-up
  (`uploads.remove_orphan_uploads`);
- entries of `runs/.trash` whose deletion was cut short (a crash, a pruning's transaction rolled
  back after its renames): gone only at a start-up (`projection.empty_trash`).

With several service processes on one data directory (DESIGN §10: replicas on a shared volume) each
runs this pass (the sweeper takes no lease: every process sweeps, and every job is safe against
another process's), so one process's leftovers go without waiting for it to restart.

Never what is in flight. What proves an entry is a leftover differs by kind:
- A step directory under its final name (`step_N`) is moved there under its run's row lock, and its
  row follows in that transaction (`store_adapter`). It goes when it has no row read without a lock
  (most passes find none, and take no lock) and again under the run's lock: a publish that moved it
  in meanwhile has committed its row by then (Postgres: the statement after the lock sees it;
  SQLite: every transaction holds the write lock). `remove_pruned_files`'s protocol, for the steps
  found; no clock is involved. It goes through `runs/.trash`, deleted after the commit.
- A cached archive is never the only copy of anything: a download opens it before it sends, and one
  missing is built again. One whose step has no row, or whose name holds another sha256 than its
  step's row (a step published again), is unlinked without a lock.
- A staging directory or a temporary file is written outside any lock (a publish unpacks and checks
  its body first), and its name says nothing of its state: only one untouched for
  ORPHAN_GRACE_SECONDS goes, no mtime or ctime of it, or of the entries in it, that recent. A body
  has arrived whole before it is unpacked (its route spools it first, within the request guard's
  `body_timeout_seconds`), so an upload writes at disk speed, then waits for its locks: an hour is
  far above either. A rename sets the ctime (Linux's file systems), so an entry just moved into
  place, or into the trash, counts as touched.
- An uploaded adapter's directory, staged or in place, is held by its upload with a shared flock
  until the upload's transaction ends (`uploads._locked_staging`). It goes when it is idle past the
  grace, no row names it, its exclusive flock is free (no upload, in this process or another,
  holds it), and, asked again under that flock, still no row names it. The grace also guards file
  systems whose flocks other machines do not see: a directory moved into place holds its archive,
  written just before the move.
- A trash entry is doomed whatever happens (its rows' deletion committed, or it is a deleted run's
  directory); one idle past the grace goes, so a removal under way is left to its owner.

Bounded: a pass reads RUN_PAGE runs a sweep (by id, a cursor kept between sweeps as the pruning's
`AdapterScan` is), lists two directories of each and reads rows only for the steps found there; and
PAGE names of the uploads' directory and of the trash a sweep. No transaction is open while a
directory is listed or a tree deleted, but for the renames of a run's step directories under its
lock. A pass begins at the sweeper's first sweep (so a start-up reconciles what a crash left) and
again RECONCILE_SECONDS after the last began, once it caught up.
"""

import fcntl
import logging
import os
import re
import shutil
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import exists, select
from sqlalchemy.orm import Session, sessionmaker

from app.adapters.models import Adapter, TenantAdapter
from app.adapters.pruning import ARCHIVE, STEP_DIR, trash_after_commit
from app.adapters.service import ARCHIVE_CACHE_DIR
from app.adapters.uploads import STAGING_PREFIX, uploads_dir
from app.config import Settings
from app.projection import TRASH_DIR, run_dir
from app.retention import PURGE_CHUNK
from app.runs.models import Run
from contracts.ids import is_issued_id
from contracts.layout import BROADCAST_DIR, step_dir_name
from contracts.status import RunStatus

log = logging.getLogger(__name__)

ORPHAN_GRACE_SECONDS = 3600.0
"""How long a staging directory, a temporary file, an uploaded adapter's directory without a row or
a trash entry must have been untouched before it goes (see the module's docstring)."""
RECONCILE_SECONDS = 3600.0
"""How often a pass begins again (once the last one caught up)."""
RUN_PAGE = 100
"""Runs a sweep looks at."""
PAGE = 500
"""Names of the uploads' directory, and of the trash, a sweep looks at (each)."""
STEPS_A_QUERY = 1000
"""Steps one row query asks for (its IN list)."""
ORPHAN_STEPS_A_RUN = PURGE_CHUNK
"""Step directories one transaction renames under a run's lock; more go at the next pass."""
_ENTRIES_LOOKED_AT = 64
"""Entries of a directory whose times say when it was last touched (ours hold a handful)."""

_STAGED_STEP = re.compile(r"^\.step_[0-9]+\.[0-9a-f]{8}\.(?:tmp|old)$")
"""Under broadcast/: a publish's staging directory, or a step's copy replaced by a new publish."""
_ARCHIVE_TEMPORARY = re.compile(r"^\.adapter_step_[0-9]+_[0-9a-f]+\.tar\.gz\.[0-9a-f]{8}\.tmp$")
"""Under cache/: an archive being built (`service._build_archive`)."""


@dataclass
class ReconcileScan:
    """Where the reconcile pass stands; the sweeper keeps one between sweeps."""

    started_at: datetime | None = None
    """When the pass began (None: none yet)."""
    after_run: str = ""
    """The runs up to this id were looked at."""
    runs_done: bool = False
    after_upload: str = ""
    """The names of the uploads' directory up to this one were looked at."""
    uploads_done: bool = False
    after_trash: str = ""
    """The trash entries up to this name were looked at."""
    trash_done: bool = False

    @property
    def caught_up(self) -> bool:
        return self.runs_done and self.uploads_done and self.trash_done

    def begin(self, now: datetime) -> bool:
        """Whether this sweep reconciles: a pass under way goes on; a new one begins at the first
        sweep, and once the last one caught up and began RECONCILE_SECONDS ago."""
        due = self.started_at is None or (
            self.caught_up and now - self.started_at >= timedelta(seconds=RECONCILE_SECONDS)
        )
        if due:
            self.started_at, self.after_run, self.after_upload, self.after_trash = now, "", "", ""
            self.runs_done = self.uploads_done = self.trash_done = False
        return not self.caught_up


@dataclass
class Reconciled:
    """What one sweep's share of the pass removed."""

    run_files: int = 0
    """Step directories and cached archives no row refers to, staging leftovers and temporaries."""
    uploads: int = 0
    """Uploaded adapters' directories without a row, and upload staging leftovers."""
    trash_entries: int = 0
    """Entries of runs/.trash a removal left."""
    failed: list[str] = field(default_factory=list)
    """What failed (logged with its traceback; the next pass tries again)."""


def reconcile_adapter_files(
    factory: sessionmaker[Session], *, settings: Settings, scan: ReconcileScan, now: datetime
) -> Reconciled:
    """This sweep's share of the pass `scan` stands in (none between passes): the next page of runs,
    of uploads and of the trash. Each database read or change is a short transaction of its own."""
    done = Reconciled()
    if not scan.begin(now):
        return done
    cutoff = now.timestamp() - ORPHAN_GRACE_SECONDS
    if not scan.runs_done:
        _reconcile_runs(factory, settings=settings, scan=scan, cutoff=cutoff, done=done)
    if not scan.uploads_done:
        _reconcile_uploads(factory, settings=settings, scan=scan, cutoff=cutoff, done=done)
    if not scan.trash_done:
        _empty_stale_trash(settings, scan=scan, cutoff=cutoff, done=done)
    return done


# ---------------------------------------------------------------- runs' step adapters


def _reconcile_runs(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    scan: ReconcileScan,
    cutoff: float,
    done: Reconciled,
) -> None:
    with factory() as session:
        page = list(
            session.scalars(
                select(Run.id)
                .where(Run.id > scan.after_run, Run.status != RunStatus.DELETED)
                .order_by(Run.id)
                .limit(RUN_PAGE)
            )
        )
    for run_id in page:
        try:
            done.run_files += reconcile_run(factory, run_id=run_id, settings=settings, cutoff=cutoff)
        except Exception:
            log.exception("reconcile: the adapter files of run %s failed; the next pass tries again", run_id)
            done.failed.append(run_id)
    if page:
        scan.after_run = page[-1]
    scan.runs_done = len(page) < RUN_PAGE


def reconcile_run(factory: sessionmaker[Session], *, run_id: str, settings: Settings, cutoff: float) -> int:
    """Remove the run's step directories and cached archives no row refers to, and its staging
    leftovers and temporaries untouched since `cutoff` (seconds since the epoch). Returns how many."""
    root = run_dir(settings, run_id)
    broadcast, cache = root / BROADCAST_DIR, root / ARCHIVE_CACHE_DIR
    broadcast_names, cache_names = _names(broadcast), _names(cache)
    leftovers = [broadcast / n for n in broadcast_names if _STAGED_STEP.match(n)]
    leftovers += [cache / n for n in cache_names if _ARCHIVE_TEMPORARY.match(n)]
    removed = sum(_remove(path) for path in leftovers if _idle(path, cutoff))
    steps = {int(m[1]) for n in broadcast_names if (m := STEP_DIR.match(n))}
    archives = [(cache / n, int(m[1]), m[2]) for n in cache_names if (m := ARCHIVE.match(n))]
    if not steps and not archives:
        return removed
    with factory() as session:  # no lock: most runs have nothing to remove
        published = published_steps(session, run_id=run_id, steps=steps | {step for _, step, _ in archives})
    for path, step, sha in archives:
        if not published.get(step, "").startswith(sha):
            path.unlink(missing_ok=True)
            removed += 1
    unreferenced = sorted(steps - published.keys())[:ORPHAN_STEPS_A_RUN]
    if unreferenced:
        with factory() as session:
            moved = remove_unreferenced_steps(session, run_id=run_id, steps=unreferenced, settings=settings)
            session.commit()
        if moved:
            log.info("reconcile: removed %s step adapter directories of run %s without a row", moved, run_id)
        removed += moved
    return removed


def published_steps(session: Session, *, run_id: str, steps: Collection[int]) -> dict[int, str]:
    """Of these steps of the run, those with a row, with their weights' sha256."""
    ordered, found = sorted(steps), {}
    for i in range(0, len(ordered), STEPS_A_QUERY):
        chunk = ordered[i : i + STEPS_A_QUERY]
        rows = session.execute(
            select(Adapter.step, Adapter.sha256).where(Adapter.run_id == run_id, Adapter.step.in_(chunk))
        )
        found.update({step: sha for step, sha in rows})
    return found


def remove_unreferenced_steps(
    session: Session, *, run_id: str, steps: Collection[int], settings: Settings
) -> int:
    """Under the run's row lock, move the directories of those of `steps` that still have no row into
    runs/.trash (deleted there once the transaction commits). Returns how many. Never commits."""
    run = session.get(Run, run_id, with_for_update=True, populate_existing=True)
    if run is None or run.status == RunStatus.DELETED:
        return 0  # its directory goes whole (app/projection.py)
    published = published_steps(session, run_id=run_id, steps=steps)
    broadcast = run_dir(settings, run_id) / BROADCAST_DIR
    doomed = [broadcast / step_dir_name(step) for step in sorted(steps) if step not in published]
    return trash_after_commit(session, run_id=run_id, paths=doomed, settings=settings)


# ---------------------------------------------------------------- uploaded adapters


def _reconcile_uploads(
    factory: sessionmaker[Session],
    *,
    settings: Settings,
    scan: ReconcileScan,
    cutoff: float,
    done: Reconciled,
) -> None:
    root = uploads_dir(settings)
    ours = sorted(n for n in _names(root) if _is_upload(n) or n.startswith(STAGING_PREFIX))
    page, scan.after_upload, scan.uploads_done = _page(ours, after=scan.after_upload)
    idle = [n for n in page if _idle(root / n, cutoff)]
    if not idle:
        return
    with factory() as session:
        ids = [n for n in idle if _is_upload(n)]
        kept = (
            set(session.scalars(select(TenantAdapter.id).where(TenantAdapter.id.in_(ids)))) if ids else set()
        )
    for name in idle:
        if name in kept:
            continue
        try:
            done.uploads += remove_unheld_upload(factory, root / name)
        except Exception:
            log.exception(
                "reconcile: the uploaded adapter directory %s failed; the next pass tries again", name
            )
            done.failed.append(name)


def _is_upload(name: str) -> bool:
    return is_issued_id(name, "adp")


def remove_unheld_upload(factory: sessionmaker[Session], path: Path) -> bool:
    """Delete an upload's directory found without a row, unless an upload holds it (its flock) or, asked
    again once no upload can, its row has been committed meanwhile. Returns whether it went."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone meanwhile, or not a directory
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # an upload holds it: its transaction is under way
        if _is_upload(path.name):
            with factory() as session:
                if session.scalar(select(exists().where(TenantAdapter.id == path.name))):
                    return False
        gone = _remove(path)
    finally:
        os.close(fd)
    if gone:
        log.info("reconcile: removed the uploaded adapter directory %s, which no row names", path)
    return gone


# ---------------------------------------------------------------- the trash


def _empty_stale_trash(settings: Settings, *, scan: ReconcileScan, cutoff: float, done: Reconciled) -> None:
    trash = settings.runs_dir / TRASH_DIR
    page, scan.after_trash, scan.trash_done = _page(sorted(_names(trash)), after=scan.after_trash)
    for name in page:
        path = trash / name
        if _idle(path, cutoff):
            done.trash_entries += _remove(path)
    if done.trash_entries:
        log.info("reconcile: deleted %s entries left in %s", done.trash_entries, trash)


# ---------------------------------------------------------------- the file system


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _page(names: list[str], *, after: str) -> tuple[list[str], str, bool]:
    """The next PAGE of the sorted `names` past `after`: (the page, the cursor after it, whether it
    was the last)."""
    rest = [n for n in names if n > after]
    page = rest[:PAGE]
    return page, page[-1] if page else after, len(rest) <= PAGE


def _last_touched(path: Path) -> float | None:
    """The newest mtime or ctime of `path` and, a directory, of the entries in it (seconds since the
    epoch); None when it is gone or cannot be read."""
    try:
        own = os.lstat(path)
        newest = max(own.st_mtime, own.st_ctime)
        if stat.S_ISDIR(own.st_mode):
            with os.scandir(path) as entries:
                for i, entry in enumerate(entries):
                    if i == _ENTRIES_LOOKED_AT:
                        break
                    inner = entry.stat(follow_symlinks=False)
                    newest = max(newest, inner.st_mtime, inner.st_ctime)
    except OSError:  # gone meanwhile; or unreadable, and then left alone
        return None
    return newest


def _idle(path: Path, cutoff: float) -> bool:
    touched = _last_touched(path)
    return touched is not None and touched <= cutoff


def _remove(path: Path) -> bool:
    """Delete a file or a tree; whether it is gone (removed meanwhile by another process counts)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return not os.path.lexists(path)
