"""A deleted run's files on the pool's disk go once the service says the run is deleted.

`<checkpoint home>/<run_id>/` holds what the pool keeps of a run: its checkpoints
(`checkpoints/step_N`: adapter, optimizer, progress), the Tinker states saved by name
(`tinker_states/`) and the sampler copies (`sampler_weights/`). They stay while the run exists,
whatever its state: a run also leaves the pool when it is evicted, completed or failed, and then its
checkpoint may still start another run (`init_from`) and an evicted Tinker model's saved states stay
loadable. They go when the run is deleted (README: a saved state stays "until its run is deleted").

The pool's state lists active runs only, so the pool cannot tell a deletion from an eviction by a
run's absence: it asks the service (`POST /v1/pool/runs/deleted`, `contracts.pool_api.DeletedRunsIn`):

- about a run that left it, at the next check after the release (`RunFiles.left`): a run deleted
  while the pool trained it loses its files at once;
- at start-up and then every `SWEEP_INTERVAL_S`, about the runs it has files for, at most
  `MAX_DELETED_QUERY` per pass, each pass going on after the last name the previous one asked (a
  large home is covered in turn): runs deleted while no pool held them or while the pool was down.

The service names only runs it holds with status deleted, or remembers as deleted with their tenant
(their ids kept as long as a deleted run's row). A run it holds nothing for keeps its files:
it may be another service's (the default checkpoint home is the service's default data directory, so
a pool started with `--url` at a remote service from where a local one ran; a database restored
beside the old checkpoint volume; two stacks sharing a `--checkpoint-dir`), and a removal cannot be
undone. Known gap: a run purged after the deletion's retention while the pool was down (or deleted with
its tenant before the service kept such ids, migration 0023) keeps its files on a pool's own disk;
remove them by hand.

An unanswered question removes nothing (the next pass asks again), and a service without the route
(older than the pool) leaves every file where it is, as before. A pool whose home is the service's
data directory (compose's shared volume) finds most of them gone already: the service removes a
deleted run's directory itself.

Safety: only entries directly under the home named by an issued run id (`contracts.ids.is_run_id`)
are touched, never the directory of a run the pool holds; a symbolic link is removed as a link (what
it points to, outside the home, stays). A removal renames the run's directory into
`<home>/.pool-trash/` (atomic, and the home is fsynced: the run is gone as a whole, never half of
its checkpoints), then deletes it there; what a crash leaves in the trash the next start deletes.
Master rank only, between steps (the loop is the only writer of the home).
"""

import logging
import math
import os
import secrets
import shutil
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from contracts.durable import fsync_path
from contracts.http import ApiError
from contracts.ids import is_run_id
from contracts.pool_api import MAX_DELETED_QUERY

log = logging.getLogger("loraloom.worker")

TRASH_DIR = ".pool-trash"
"""Under the checkpoint home: run directories being removed (not a run id: no sweep lists it, nor
the service's own start-up rebuild when the home is its data directory)."""
SWEEP_INTERVAL_S = 300.0
"""How often the pool asks about the runs it has files for (runs deleted while it did not hold them)."""
QUIET_AFTER_FAILURE_S = 30.0
"""After an unanswered question, the pool asks nothing for this long (not at every turn of its loop)."""


@runtime_checkable
class DeletedRunsSource(Protocol):
    """A run source that can say which runs are deleted (the service; `HttpRunSource`)."""

    def deleted_runs(self, run_ids: list[str]) -> set[str]:
        """Of `run_ids` (at most `MAX_DELETED_QUERY`), those the service holds as deleted (never an id
        it does not know); raises when it cannot say."""
        ...


def _gone_is_fine(
    _function: object, failed: str, exc_info: tuple[type[BaseException], BaseException, object]
) -> None:
    # Another pool sharing the home may empty the same trash: what it deleted first is no error.
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def _delete(path: Path) -> None:
    """Delete a file, a link or a tree (a link itself, never what it points to)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return
    except FileNotFoundError:
        return
    shutil.rmtree(path, onerror=_gone_is_fine)


def remove_run_files(home: Path, run_id: str) -> bool:
    """Remove `<home>/<run_id>` as a whole (see the module docstring); True when this call removed it.

    `run_id` must be an issued run id: a single path component, so the path cannot leave `home`.
    """
    if not is_run_id(run_id):
        raise ValueError(f"not a run id the service issues: {run_id!r}")
    path = home / run_id
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(mode):  # a link (or a stray file) under the run's name: the entry alone goes
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        fsync_path(home)
        return True
    trash = home / TRASH_DIR
    trash.mkdir(exist_ok=True)
    doomed = trash / f"{run_id}.{secrets.token_hex(4)}"
    try:
        os.rename(path, doomed)
    except FileNotFoundError:
        return False  # removed meanwhile (another pool sharing the home, or the service)
    fsync_path(home)
    _delete(doomed)
    return True


def empty_trash(home: Path) -> None:
    """Delete what removals cut short by a crash left in `<home>/.pool-trash/`."""
    trash = home / TRASH_DIR
    try:
        names = os.listdir(trash)
    except FileNotFoundError:
        return
    for name in names:
        try:
            _delete(trash / name)
        except OSError as exc:  # housekeeping must not stop the pool; the next start tries again
            log.warning("could not delete %s from the pool's trash: %s", name, exc)


def run_names(home: Path) -> list[str]:
    """The issued run ids with an entry directly under `home`, sorted."""
    try:
        with os.scandir(home) as entries:
            return sorted(e.name for e in entries if is_run_id(e.name))
    except FileNotFoundError:
        return []


@dataclass
class RunFiles:
    """The master's housekeeping of its checkpoint home (see the module docstring)."""

    home: Path
    source: DeletedRunsSource
    interval_s: float = SWEEP_INTERVAL_S
    batch: int = MAX_DELETED_QUERY
    _left: set[str] = field(default_factory=set)
    """Runs that left the pool since the last answer about them."""
    _after: str = ""
    """The sweep's cursor: the next pass asks about names after this one."""
    _next_sweep: float = -math.inf
    _quiet_until: float = -math.inf
    _off: bool = False
    """The service has no answer to give (older than the pool): nothing is ever removed."""

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= MAX_DELETED_QUERY:
            raise ValueError(f"batch must be within 1..{MAX_DELETED_QUERY}, got {self.batch}")

    def start(self, *, held: Collection[str] = ()) -> list[str]:
        """At start-up: empty the trash, then the first sweep (before any run is admitted)."""
        empty_trash(self.home)
        return self.check(held=held)

    def left(self, run_id: str) -> None:
        """`run_id` left the pool: ask about it at the next `check` (it may have been deleted)."""
        if is_run_id(run_id):
            self._left.add(run_id)

    def check(self, *, held: Collection[str], now: float | None = None) -> list[str]:
        """Ask about the runs that left, and sweep when due; remove the deleted ones' files, never
        those of a run in `held` (the pool's slots: it may still write them). The ids removed."""
        now = time.monotonic() if now is None else now
        if self._off or now < self._quiet_until:
            return []
        removed: list[str] = []
        asked = sorted(self._left - set(held))[: self.batch]
        if asked:
            deleted = self._ask(asked, now)
            if deleted is None:
                return []
            self._left.difference_update(asked)
            removed += self._remove(deleted, held)
        if now >= self._next_sweep:
            self._next_sweep = now + self.interval_s
            removed += self._sweep(held, now)
        return removed

    def _sweep(self, held: Collection[str], now: float) -> list[str]:
        names = [n for n in run_names(self.home) if n not in held]
        page = [n for n in names if n > self._after][: self.batch]
        if len(page) < self.batch:  # wrapped: the names before the cursor come next
            page += [n for n in names if n <= self._after and n not in page][: self.batch - len(page)]
        if not page:
            return []
        deleted = self._ask(page, now)
        if deleted is None:
            return []  # asked again at the next pass, from the same cursor
        self._after = page[-1]
        return self._remove(deleted, held)

    def _ask(self, run_ids: list[str], now: float) -> set[str] | None:
        try:
            return self.source.deleted_runs(run_ids)
        except ApiError as exc:
            self._quiet_until = now + QUIET_AFTER_FAILURE_S
            if exc.status in (404, 405):
                self._off = True
                log.warning(
                    "the service does not answer which runs are deleted (%s; older than this pool?): "
                    "the files of deleted runs stay in %s",
                    exc,
                    self.home,
                )
                return None
            log.warning("could not ask the service which runs are deleted (%s); nothing removed", exc)
        except Exception as exc:  # the service down (after the short retries): the next pass asks again
            self._quiet_until = now + QUIET_AFTER_FAILURE_S
            log.warning("could not ask the service which runs are deleted (%s); nothing removed", exc)
        return None

    def _remove(self, deleted: Collection[str], held: Collection[str]) -> list[str]:
        removed = []
        for run_id in sorted(deleted):
            if run_id in held or not is_run_id(run_id):
                continue
            try:
                if remove_run_files(self.home, run_id):
                    removed.append(run_id)
                    log.info("run %s is deleted: its checkpoints and saved weights removed", run_id)
            except OSError as exc:  # a file we cannot delete must not stop the training
                log.warning("could not remove the files of deleted run %s: %s", run_id, exc)
        return removed


__all__ = [
    "SWEEP_INTERVAL_S",
    "TRASH_DIR",
    "DeletedRunsSource",
    "RunFiles",
    "empty_trash",
    "remove_run_files",
    "run_names",
]
