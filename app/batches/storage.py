"""Rollout payload files under `{data_dir}/runs/{run_id}/rollouts/step_N/`.

A payload is the validated batch in its binary form (contracts/arrays.py: the body itself for a
binary body, the canonical encoding of the converted lists for a list body), written
atomically (temporary file, fsync, rename, fsync of the directory) BEFORE its row is
committed. So a committed row always points at a complete file, and a crash between
the two leaves at worst an unreferenced file: never served (the pool reads payloads
through rows only), and removable by `remove_orphan_payloads`.
"""

import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.batches.models import Batch
from app.config import Settings
from app.errors import AppError
from app.projection import run_dir
from contracts.arrays import ArrayBatch, decode_stored
from contracts.durable import atomic_write_bytes
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


def rollouts_dir(settings: Settings, run_id: str) -> Path:
    return run_dir(settings, run_id) / ROLLOUTS_DIR  # run_dir refuses anything but a run id


def write_payload(
    settings: Settings, *, run_id: str, rollout_step: int, data: bytes, sha256: str | None = None
) -> StoredPayload:
    """Write `data` durably as a new payload file of the run; returns where and its digest
    (pass `sha256` when it is known already: hashing a large payload twice is measurable)."""
    path = (
        rollouts_dir(settings, run_id)
        / step_dir_name(rollout_step)
        / f"batch_{uuid.uuid4().hex}{PAYLOAD_SUFFIX}"
    )
    atomic_write_bytes(path, data)
    return StoredPayload(
        relative_path=path.relative_to(settings.data_dir).as_posix(),
        size_bytes=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
    )


def discard_payload(settings: Settings, relative_path: str) -> None:
    """Best-effort removal of a payload whose row was never committed."""
    try:
        (settings.data_dir / relative_path).unlink(missing_ok=True)
    except OSError as exc:  # an orphan is harmless; the start-up clean-up gets it later
        log.warning("could not remove orphan payload %s: %s", relative_path, exc)


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


def remove_orphan_payloads(session: Session, *, settings: Settings, older_than_s: float = 3600.0) -> int:
    """Delete payload files no row references (a crash between the file write and the commit).

    Only files older than `older_than_s` go: with several API replicas on one volume,
    a younger file may belong to a request whose commit is still in flight.
    Returns how many files were removed.
    """
    root = settings.runs_dir
    if not root.exists():
        return 0
    referenced = set(session.scalars(select(Batch.payload_path)))
    cutoff = time.time() - older_than_s
    removed = 0
    for path in root.glob(f"run_*/rollouts/step_*/batch_*{PAYLOAD_SUFFIX}"):
        rel = path.relative_to(settings.data_dir).as_posix()
        if rel in referenced:
            continue
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed
