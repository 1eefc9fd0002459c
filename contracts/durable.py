"""Durable, atomic file-system writes, shared by the service's artifact store, the pool's
checkpoints and adapter exports, and run-directory control files.

Every file the service acknowledges is written to a temporary name in the same
directory, fsynced, renamed into place, and the directory fsynced, so a crash
leaves either the old state or the new one, never half a file.
"""

import os
import re
import shutil
import stat
import uuid
from pathlib import Path

TMP_SUFFIX = ".tmp"
OLD_SUFFIX = ".old"
"""A directory's copy that `atomic_replace_dir` replaced (deleted right after the move)."""
_UNIQUE_HEX = 8
_BESIDE = re.compile(rf"\.(.+)\.[0-9a-f]{{{_UNIQUE_HEX}}}(?:{re.escape(TMP_SUFFIX)}|{re.escape(OLD_SUFFIX)})")


def beside(final: Path, suffix: str = TMP_SUFFIX) -> Path:
    """A new name next to `final` for what is written before it moves there (or, `OLD_SUFFIX`, what it
    replaced): hidden, unique, and telling whose it is (`final_name_of`)."""
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:_UNIQUE_HEX]}{suffix}")


def final_name_of(name: str) -> str | None:
    """The name of the file or directory a name made by `beside` stands next to; None for any other."""
    match = _BESIDE.fullmatch(name)
    return match[1] if match else None


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (a rename or a new entry is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def process_umask() -> int:
    """The process's umask. Linux says it in /proc/self/status, read without changing it; elsewhere
    it is read by setting it and putting it back, the strictest one meanwhile (a file another thread
    creates in that instant gets fewer permissions, never more)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give `path` the permissions a plain `open()` (a file) or `mkdir()` (a directory) would have
    given it: 0o666 or 0o777 less the umask. For what a library writes with a mode of its own:
    safetensors' `save_file` (and transformers' `save_pretrained`, which uses it) always leaves 0600,
    writing a temporary file and renaming it; `tempfile.mkdtemp` makes 0700. In a shared cache or
    directory, those were unreadable to its other users, while every other file followed the umask."""
    # Through a descriptor opened without following a link: a name swapped for a symlink meanwhile
    # (in a group-writable directory) fails here instead of widening the link's target.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            # A shared directory's setgid (its files keep its group) and sticky bits stay.
            wanted = (0o777 & ~process_umask()) | (mode & (stat.S_ISGID | stat.S_ISVTX))
        elif stat.S_ISREG(mode):
            wanted = 0o666 & ~process_umask()
        else:
            raise OSError(f"{path} is neither a regular file nor a directory")
        os.fchmod(fd, wanted)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = beside(path)
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
        trash = beside(final, OLD_SUFFIX)
        os.replace(final, trash)
        os.replace(staging, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_path(final.parent)


def remove_stale_temporaries(root: Path) -> int:
    """Delete leftovers of interrupted atomic writes (start-up clean-up): every temporary file under
    `root`, so a crash leaves nothing half-written behind a restart. Returns how many.

    Every one, not only idle ones: a replica sharing the data directory that is writing one at this
    moment fails that request's rename (a 5xx, nothing committed), and the client's retry stores it;
    the idle-only clean-up of temporary directories is the adapters' reconcile's."""
    if not root.exists():
        return 0
    removed = 0
    for p in root.rglob(f"*{TMP_SUFFIX}"):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue  # renamed into place meanwhile
        if stat.S_ISREG(st.st_mode):
            p.unlink(missing_ok=True)
            removed += 1
    return removed


_ENTRIES_LOOKED_AT = 64
"""Entries of a directory whose times `untouched` reads (a staging directory holds a handful)."""


def untouched(path: Path, *, since: float) -> bool:
    """Whether nothing of `path` changed after `since` (seconds since the epoch): its mtime and ctime
    and, a directory, those of its first entries (a rename sets the ctime: an entry just moved in
    counts as touched). False when it is gone or cannot be read: then it is left alone."""
    try:
        own = os.lstat(path)
        newest = max(own.st_mtime, own.st_ctime)
        if stat.S_ISDIR(own.st_mode):
            with os.scandir(path) as entries:
                for _, entry in zip(range(_ENTRIES_LOOKED_AT), entries, strict=False):
                    inner = entry.stat(follow_symlinks=False)
                    newest = max(newest, inner.st_mtime, inner.st_ctime)
    except OSError:
        return False
    return newest <= since
