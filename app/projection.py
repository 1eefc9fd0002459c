"""Database → run directories.

The database is the source of truth; `{data_dir}/runs/run_xxx/` is a projection of it in
the layout of the source documents, so that a trainer reading directories, and people
reading files, see what the service decided:

    control/orch.toml                    the run config, as TOML
    control/evicted.txt                  the eviction reason, once evicted
    control/config_validation_error.txt  why admission failed, once failed
    rollouts/  broadcast/  checkpoints/  filled by the batch, adapter and checkpoint work

Every write is atomic and idempotent; `rebuild_all` runs at start-up, so a missing or
stale directory is repaired by a restart.
"""

import logging
import os
import shutil
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tomli_w
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from app.config import Settings
from app.runs.models import Run
from contracts.durable import atomic_write_text, fsync_path, untouched
from contracts.ids import is_run_id
from contracts.layout import (
    BROADCAST_DIR,
    CHECKPOINTS_DIR,
    CONFIG_ERROR_FILE,
    CONTROL_DIR,
    EVICTED_FILE,
    ORCH_CONFIG_FILE,
    ROLLOUTS_DIR,
)
from contracts.status import RunStatus

log = logging.getLogger(__name__)

RUN_SUBDIRS = (CONTROL_DIR, ROLLOUTS_DIR, BROADCAST_DIR, CHECKPOINTS_DIR)


def run_dir(settings: Settings, run_id: str) -> Path:
    """The run's directory. Refuses anything but a run id, so no path ever escapes runs_dir."""
    if not is_run_id(run_id):
        raise ValueError(f"not a run id: {run_id!r}")
    return settings.runs_dir / run_id


def config_toml(config: dict[str, Any]) -> str:
    """The config as TOML. TOML has no null, so unset optional fields are left out (they default to None)."""
    return tomli_w.dumps(_drop_none(config))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_drop_none(v) for v in value]
    return value


def _write_if_changed(path: Path, text: str) -> None:
    # Rebuilding at start-up rewrites nothing that is already right (no needless fsyncs).
    try:
        if path.read_text() == text:
            return
    except FileNotFoundError:
        pass
    atomic_write_text(path, text)


def _remove_file(path: Path) -> None:
    if path.exists():
        path.unlink()
        fsync_path(path.parent)


def project_run(run: Run, settings: Settings) -> None:
    """Make the run's directory match its row (a deleted run's directory is removed)."""
    if run.status == RunStatus.DELETED:
        remove_run_dir(run.id, settings)
        return
    root = run_dir(settings, run.id)
    for sub in RUN_SUBDIRS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    control = root / CONTROL_DIR
    _write_if_changed(control / ORCH_CONFIG_FILE, config_toml(run.config))
    if run.status == RunStatus.EVICTED:
        _write_if_changed(control / EVICTED_FILE, (run.eviction_reason or "evicted") + "\n")
    else:
        _remove_file(control / EVICTED_FILE)
    if run.status == RunStatus.FAILED:
        _write_if_changed(control / CONFIG_ERROR_FILE, (run.failure_reason or "failed") + "\n")
    else:
        _remove_file(control / CONFIG_ERROR_FILE)


TRASH_DIR = ".trash"
"""Under runs_dir: run directories, and pruned steps' files, being removed (what a removal cut short
left, the start-up empties, and the sweeper's reconcile pass: app/adapters/reconcile.py)."""


def remove_run_dir(run_id: str, settings: Settings) -> None:
    """Remove the run's directory: renamed into runs_dir/.trash first, then deleted there.

    The rename is atomic, so a request still writing into the run (a batch, an adapter archive: they
    address its files by path) can no longer add an entry to the tree being deleted, which made
    rmtree fail with "Directory not empty" and leave the directory of a deleted run; such a request
    now recreates the run's path at worst, and removes it again once its own refusal says the run
    is deleted. Several removals of one run at once are fine: one rename wins, the others find
    nothing."""
    root = run_dir(settings, run_id)
    trash = settings.runs_dir / TRASH_DIR
    doomed = trash / f"{run_id}.{uuid.uuid4().hex[:8]}"
    for _ in range(3):
        trash.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(root, doomed)
            break
        except FileNotFoundError:
            if not root.exists():
                return  # removed already (by another removal of the same run)
            # else the trash itself went between the mkdir and the rename: make it again
    else:
        doomed = root  # the trash keeps going (it should not): remove the tree where it is
    fsync_path(root.parent)
    remove_tree(doomed)


def names_in(folder: Path) -> list[str]:
    """The names in `folder`; none when it does not exist."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def remove_tree(path: Path) -> bool:
    """Delete a file or a tree; whether this call removed it (False: gone already). An entry gone
    meanwhile (another process emptying the trash too) is no error; any other failure is raised."""
    top, top_gone = os.fspath(path), False

    def gone_is_fine(
        _function: object, failed: str, exc_info: tuple[type[BaseException], BaseException, object]
    ) -> None:
        nonlocal top_gone
        if not isinstance(exc_info[1], FileNotFoundError):
            raise exc_info[1]
        top_gone = top_gone or failed == top

    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            os.unlink(top)
            return True
    except FileNotFoundError:
        return False
    shutil.rmtree(top, onerror=gone_is_fine)
    return not top_gone


def empty_trash(
    settings: Settings, *, names: Iterable[str] | None = None, untouched_since: float | None = None
) -> int:
    """Delete entries of the trash, removals a crash cut short: all of them, or those of `names`; with
    `untouched_since` (seconds since the epoch), only those untouched since (`durable.untouched`):
    one touched later may be a removal under way in another process. Entries, not the trash itself:
    another process may be renaming a run's directory into it right now. Returns how many this call
    removed."""
    trash = settings.runs_dir / TRASH_DIR
    doomed = [trash / name for name in (names_in(trash) if names is None else names)]
    if untouched_since is not None:
        doomed = [path for path in doomed if untouched(path, since=untouched_since)]
    return sum(remove_tree(path) for path in doomed)


def rebuild_all(session: Session, settings: Settings) -> None:
    """Rebuild every run directory from the database (idempotent), and remove the directories of
    runs the database does not hold (a crash between a projection and a failed commit).

    The directories are listed before the rows are read: a run created meanwhile (by another
    replica) is projected only after its commit (`project_after_commit`), so its row is visible
    to the read below whenever its directory was in the listing."""
    settings.runs_dir.mkdir(parents=True, exist_ok=True)
    empty_trash(settings)
    on_disk = {p.name for p in settings.runs_dir.iterdir() if p.is_dir() and is_run_id(p.name)}
    known: set[str] = set()
    for run in session.scalars(select(Run).execution_options(yield_per=500)):
        project_run(run, settings)
        known.add(run.id)
    stray = sorted(on_disk - known)
    for run_id in stray:
        remove_run_dir(run_id, settings)
    log.info(
        "projected %d run directories under %s; removed %d stray ones",
        len(known),
        settings.runs_dir,
        len(stray),
    )


def project_after_commit(session: Session, run: Run, settings: Settings) -> None:
    """Project `run` once the session's transaction commits (never for a rolled-back one, so no
    directory exists without its row). A failure is logged: the start-up rebuild repairs it."""

    def _project(_session: Session) -> None:
        try:
            project_run(run, settings)
        except Exception:
            log.exception("projection of run %s failed after commit; the start-up rebuild repairs it", run.id)

    event.listen(session, "after_commit", _project, once=True)
