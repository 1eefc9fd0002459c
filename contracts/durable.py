"""Durable, atomic file-system writes, shared by the service's artifact store, the pool's
checkpoints and adapter exports, and run-directory control files.

Every file the service acknowledges is written to a temporary name in the same
directory, fsynced, renamed into place, and the directory fsynced, so a crash
leaves either the old state or the new one, never half a file.
"""

import os
import shutil
import stat
import time
import uuid
from pathlib import Path

TMP_SUFFIX = ".tmp"


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (a rename or a new entry is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_replace_dir(staging: Path, final: Path) -> None:
    """Move a fully written staging directory to `final`, replacing what was there."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        trash = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.old")
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_path(final.parent)


def remove_stale_temporaries(root: Path, *, idle_seconds: float, now: float | None = None) -> int:
    """Delete leftovers of interrupted atomic writes (start-up clean-up): temporary files untouched
    (mtime and ctime) for `idle_seconds`. Returns how many.

    Only idle ones: another process sharing the directory (a second service replica) may be writing
    one right now, and removing it would fail that write's rename."""
    if not root.exists():
        return 0
    cutoff = (time.time() if now is None else now) - idle_seconds
    removed = 0
    for p in root.rglob(f"*{TMP_SUFFIX}"):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue  # renamed into place meanwhile
        if stat.S_ISREG(st.st_mode) and max(st.st_mtime, st.st_ctime) < cutoff:
            p.unlink(missing_ok=True)
            removed += 1
    return removed
