"""Per-run checkpoints, written atomically.

Layout of one checkpoint, ``{ckpt_root}/step_{N}/``::

    adapter.safetensors   the run's adapter tensors
    optimizer.pt          optimizer + scheduler + counters (torch.save, weights_only-loadable)
    progress.json         {"step": N, "progress": {...}}
    extra.pt              optional caller state (torch.save, weights_only-loadable)
    STABLE                       written last: only a directory holding it is a checkpoint

Protocol: everything is written into a temporary directory inside ``ckpt_root`` (same
filesystem, so the rename is atomic), each file fsynced, the directory fsynced, renamed
to ``step_{N}``, the parent fsynced, and only then the ``STABLE`` marker is written
(through its own fsynced temporary file and rename). A crash at any point leaves either
a temporary directory or a ``step_N`` without ``STABLE``; both are ignored by
``latest_checkpoint`` and cleaned by the next save, so the previous checkpoint stays
the one that is loaded.

One writer per ``ckpt_root`` (the run's master rank) is assumed: a save removes the
leftovers of earlier crashed saves.

A save is the root's newest state, whatever its step: the checkpoints of higher steps are
discarded after it (a Tinker run that `load_weights` older weights goes back to their step, and
the history past it is no longer the run's: restoring it would bring back weights the run left).
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from contracts.durable import follow_umask, fsync_path
from contracts.layout import STABLE_MARKER, step_dir_name, step_of_dir_name
from contracts.progress import Progress

ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
PROGRESS_FILE = "progress.json"
EXTRA_FILE = "extra.pt"
_TMP_PREFIX = ".tmp_"
_TRASH_PREFIX = ".trash_"


@dataclass
class CheckpointData:
    """What ``load_checkpoint`` returns."""

    step: int
    """The run's step at which the checkpoint was taken (steps completed)."""
    adapter: dict[str, Tensor]
    """Adapter tensors, on CPU."""
    optimizer_state: dict[str, Any]
    """As given to ``save_checkpoint`` (e.g. ``MultiRunOptimizer.state_dict(slot)``)."""
    progress: dict[str, Any]
    """JSON-able progress counters (total_samples, total_tokens, ...)."""
    extra: dict[str, Any] | None
    """Optional caller state (RNG states, ...); None when none was saved."""


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _step_dirs(ckpt_root: Path) -> list[tuple[int, Path]]:
    """All ``step_N`` directories (stable or not), by ascending step."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for entry in ckpt_root.iterdir():
        step = step_of_dir_name(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


def is_stable(path: Path) -> bool:
    return (path / STABLE_MARKER).is_file()


def stable_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Stable checkpoints by ascending step."""
    return [(step, p) for step, p in _step_dirs(ckpt_root) if is_stable(p)]


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The stable checkpoint with the highest step, or None."""
    stable = stable_checkpoints(Path(ckpt_root))
    return stable[-1][1] if stable else None


def _discard(path: Path, ckpt_root: Path) -> None:
    """Remove a directory so that no reader can ever see it half-deleted: rename it out of
    the ``step_N`` namespace first, then delete."""
    trash = Path(tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=ckpt_root))
    target = trash / path.name
    os.rename(path, target)
    fsync_path(ckpt_root)
    shutil.rmtree(trash, ignore_errors=True)


def _is_debris(entry: Path) -> bool:
    """A temporary/trash directory, or a ``step_N`` directory without STABLE: a crashed save."""
    if entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
        return True
    return step_of_dir_name(entry.name) is not None and entry.is_dir() and not is_stable(entry)


def _clean_leftovers(ckpt_root: Path) -> None:
    """Delete what crashed saves left behind (single writer per root: none of it is in progress)."""
    for entry in ckpt_root.iterdir():
        if _is_debris(entry):
            shutil.rmtree(entry, ignore_errors=True)


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    *,
    adapter: dict[str, Tensor],
    optimizer_state: dict[str, Any],
    progress: dict[str, Any],
    extra: dict[str, Any] | None = None,
    keep_last: int,
) -> Path:
    """Write ``step_{step}`` atomically, discard every checkpoint of a higher step (see the module
    docstring), then keep only the newest ``keep_last`` stable ones.

    Saving a step that already exists replaces it. Returns the checkpoint's directory.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(ckpt_root)

    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}step_{step}_", dir=ckpt_root))
    # safetensors needs contiguous CPU tensors that share no storage; copy only what must be.
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key, value in adapter.items():
        t = value.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"step": str(step)})
    follow_umask(tmp / ADAPTER_FILE)  # not safetensors' 0600
    fsync_path(tmp / ADAPTER_FILE)
    _torch_save(optimizer_state, tmp / OPTIMIZER_FILE)
    _write_text(tmp / PROGRESS_FILE, json.dumps({"step": step, "progress": progress}, sort_keys=True))
    if extra is not None:
        _torch_save(extra, tmp / EXTRA_FILE)
    # It becomes `step_N`: not mkdtemp's 0700. Widened last, once its files are written: no one else
    # can place anything in it while they are.
    follow_umask(tmp)
    fsync_path(tmp)

    final = ckpt_root / step_dir_name(step)
    if final.exists():
        _discard(final, ckpt_root)
    os.rename(tmp, final)
    fsync_path(ckpt_root)

    # The marker goes in last, itself atomically: a STABLE file is never empty or partial.
    marker_tmp = final / f"{_TMP_PREFIX}{STABLE_MARKER}"
    _write_text(marker_tmp, f"{step}\n")
    os.rename(marker_tmp, final / STABLE_MARKER)
    fsync_path(final)

    # Only after the new one is stable: a crash in between leaves the later history restorable,
    # never no checkpoint at all (a Tinker pool then replays the load: app.tinker.leases).
    stable = stable_checkpoints(ckpt_root)
    for later_step, later in stable:
        if later_step > step:
            _discard(later, ckpt_root)
    stable = [(s, p) for s, p in stable if s <= step]
    # Never the newest: keep_last >= 1 and the slice below keeps the tail.
    for _, old in stable[:-keep_last]:
        _discard(old, ckpt_root)
    return final


def checkpoint_progress(path: Path) -> Progress:
    """The progress recorded in a stable checkpoint, without loading its tensors."""
    meta = json.loads((Path(path) / PROGRESS_FILE).read_text(encoding="utf-8"))
    return Progress(**meta["progress"])


def load_checkpoint(path: Path) -> CheckpointData:
    """Load a stable checkpoint directory (as returned by ``latest_checkpoint``)."""
    path = Path(path)
    if not is_stable(path):
        raise FileNotFoundError(f"{path} is not a stable checkpoint (no {STABLE_MARKER} marker)")
    meta = json.loads((path / PROGRESS_FILE).read_text(encoding="utf-8"))
    adapter = load_file(str(path / ADAPTER_FILE), device="cpu")
    optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    extra_path = path / EXTRA_FILE
    extra = torch.load(extra_path, map_location="cpu", weights_only=True) if extra_path.exists() else None
    return CheckpointData(
        step=int(meta["step"]),
        adapter=adapter,
        optimizer_state=optimizer_state,
        progress=meta["progress"],
        extra=extra,
    )
