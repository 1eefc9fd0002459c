"""Durable file-system steps shared by checkpoints and adapter exports."""

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (a rename or a new entry is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
