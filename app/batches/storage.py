"""Rollout payload files under `{data_dir}/runs/{run_id}/rollouts/step_N/`.

A payload is the validated batch in its binary form (contracts/arrays.py: the body itself for a
binary body, the canonical encoding of the converted lists for a list body), written
atomically (temporary file, fsync, rename, fsync of the directory) BEFORE its row is
committed. So a committed row always points at a complete file, and a crash between
the two leaves at worst an unreferenced file: never served (the pool reads payloads
through rows only), and removed by `remove_orphan_payloads` at start-up.

"Never a file a request is writing": the writer holds a shared flock on the file from before
it exists under its final name (the lock is taken on the temporary file; the rename keeps the
inode) until its transaction ends (`StoredPayload.release`, called on commit or rollback). The
clean-up takes the exclusive lock without waiting, skips a file it cannot lock, and only then
asks the database whether a row references the file. Works across processes on one host.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import event, exists, select
from sqlalchemy.orm import Session

from app.batches.models import Batch
from app.config import Settings
from app.errors import AppError
from app.projection import run_dir
from contracts.arrays import ArrayBatch, decode_stored
from contracts.durable import TMP_SUFFIX, fsync_path
from contracts.layout import ROLLOUTS_DIR, step_dir_name

log = logging.getLogger("loraloom.batches")

PAYLOAD_SUFFIX = ".msgpack"


class PayloadUnreadable(AppError):
    """A committed batch whose payload file is missing or corrupt: should never happen (disk lost?)."""

    status = 500
    code = "payload_unreadable"


@dataclass(frozen=True)
class StoredPayload:
    relative_path: str
    """Relative to data_dir (what the row stores)."""
    size_bytes: int
    sha256: str
    lock_fd: int | None = field(default=None, compare=False)
    """An open descriptor holding a shared flock on the file until `release`."""

    def release(self) -> None:
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):  # closed already
                os.close(self.lock_fd)

    def release_when_transaction_ends(self, session: Session) -> None:
        # Noted on the session; the listeners below (registered once, not per request: a
        # per-session `event.listen` costs ~0.1 ms on the ingest hot path) release it.
        session.info.setdefault(_HELD_PAYLOADS, []).append(self)


_HELD_PAYLOADS = "loraloom.held_payloads"


@event.listens_for(Session, "after_commit")
@event.listens_for(Session, "after_rollback")
def _release_held_payloads(session: Session, *_args: object) -> None:
    for payload in session.info.pop(_HELD_PAYLOADS, ()):
        payload.release()


def rollouts_dir(settings: Settings, run_id: str) -> Path:
    return run_dir(settings, run_id) / ROLLOUTS_DIR  # run_dir refuses anything but a run id


def write_payload(
    settings: Settings, *, run_id: str, rollout_step: int, data: bytes, sha256: str | None = None
) -> StoredPayload:
    """Write `data` durably as a new payload file of the run; returns where and its digest
    (pass `sha256` when it is known already: hashing a large payload twice is measurable).

    The run's directory may be removed while the file is written (the run deleted meanwhile:
    `remove_run_dir` moves the whole tree away, temporary file included): then the file is
    written again under a recreated path, and the row's statement refuses the deleted run, whose
    refusal removes the path again (`service.submit_batch`)."""
    try:
        return _write_new_payload(
            settings, run_id=run_id, rollout_step=rollout_step, data=data, sha256=sha256
        )
    except FileNotFoundError:
        return _write_new_payload(
            settings, run_id=run_id, rollout_step=rollout_step, data=data, sha256=sha256
        )


def _write_new_payload(
    settings: Settings, *, run_id: str, rollout_step: int, data: bytes, sha256: str | None
) -> StoredPayload:
    path = (
        rollouts_dir(settings, run_id)
        / step_dir_name(rollout_step)
        / f"batch_{uuid.uuid4().hex}{PAYLOAD_SUFFIX}"
    )
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    fd = _create(tmp)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # held across the rename, until the transaction ends
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return StoredPayload(
        relative_path=path.relative_to(settings.data_dir).as_posix(),
        size_bytes=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        lock_fd=fd,
    )


def _create(tmp: Path) -> int:
    """A new file's descriptor, its directory made if need be. A refused batch's `discard_payload`
    removes the step's directory when it is left empty, which may happen between this request's
    mkdir and its open: then the directory is made again."""
    for _ in range(3):
        tmp.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:
            continue
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)  # the error, if it persists


def discard_payload(settings: Settings, relative_path: str) -> None:
    """Best-effort removal of a payload whose row was never committed, and of its step directory
    when that is left empty (refused batches for ever new steps left one empty directory each)."""
    path = settings.data_dir / relative_path
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # an orphan is harmless; the start-up clean-up gets it later
        log.warning("could not remove orphan payload %s: %s", relative_path, exc)
        return
    with contextlib.suppress(OSError):  # not empty (other batches of the step), or gone already
        path.parent.rmdir()


def read_payload_bytes(settings: Settings, batch: Batch) -> bytes:
    """The stored bytes of a committed batch, checked against its sha256."""
    path = settings.data_dir / batch.payload_path
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PayloadUnreadable(
            f"payload of batch {batch.id} is missing", details={"batch_id": batch.id, "error": str(exc)}
        ) from None
    if hashlib.sha256(data).hexdigest() != batch.payload_sha256:
        raise PayloadUnreadable(
            f"payload of batch {batch.id} is corrupt (sha256 mismatch)", details={"batch_id": batch.id}
        )
    return data


def read_payload(settings: Settings, batch: Batch) -> ArrayBatch:
    return decode_stored(read_payload_bytes(settings, batch))


def remove_orphan_payloads(session: Session, *, settings: Settings) -> int:
    """Delete payload files no row references (a crash between the file write and the commit),
    whatever their age, but never one a request is writing (see the module docstring).
    Returns how many files were removed."""
    root = settings.runs_dir
    if not root.exists():
        return 0
    referenced = set(session.scalars(select(Batch.payload_path)))
    removed = 0
    for path in root.glob(f"run_*/rollouts/step_*/batch_*{PAYLOAD_SUFFIX}"):
        rel = path.relative_to(settings.data_dir).as_posix()
        if rel in referenced:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a request holds it: its row is being committed
            # Unlocked: its writer's transaction has ended. Ask again (a fresh statement): it may
            # have committed since the set above was read.
            if not session.scalar(select(exists().where(Batch.payload_path == rel))):
                path.unlink(missing_ok=True)
                removed += 1
        finally:
            os.close(fd)
    return removed
