"""Adapters a tenant uploads (POST /v1/adapters) to start runs from: checked against the live pool of
their base model (rank limit, target modules, every tensor's shape), stored once under
``{data_dir}/adapters/{id}/``, tenant-scoped, listable and deletable. An upload that fails any check
is a 422 naming what is wrong, and nothing of it is kept."""

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, TypeGuard

from sqlalchemy import event, exists, func, select
from sqlalchemy.orm import Session, SessionTransaction

from app.adapters.models import TenantAdapter
from app.adapters.service import _write_archive
from app.adapters.upload import FLOAT_DTYPES, _read_safetensors_header, extract_adapter_tar, nonfinite_tensors
from app.config import Settings
from app.errors import Conflict, NotFound, ValidationFailed
from app.events.after_commit import call_after_commit
from app.pools.models import Pool
from app.runs.admission import live_pool
from app.tenants.service import lock_tenant
from contracts.ids import new_id
from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

log = logging.getLogger(__name__)

ARCHIVE = "adapter.tar.gz"
STAGING_PREFIX = ".upload_"
"""Under `{data_dir}/adapters/`: an upload being unpacked and checked, before it is moved into place."""
_ADAPTER_ID = re.compile(r"adp_[0-9a-f]{12}")
# A layer index of at most 9 ASCII digits: int() of thousands of digits raises, and `\d` takes any
# script's digits.
_TENSOR = re.compile(r"^(?:.*\.)?layers\.([0-9]{1,9})\.(?:[a-z_]+\.)?([a-z_]+)\.lora_([AB])(?:\.weight)?$")


def uploads_dir(settings: Settings) -> Path:
    return settings.data_dir / "adapters"


def _problem(field: str, message: str) -> dict[str, Any]:
    return {"loc": ["body", field], "msg": message}


def _whole_number(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON `true` is no rank


def _finite_positive(value: object) -> TypeGuard[int | float]:
    """A JSON number > 0 that is a finite float (`Infinity` and `NaN` parse; 1e999 is Infinity; an int
    too large for a float cannot be stored as the adapter's alpha)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return 0 < float(value) < math.inf
    except OverflowError:
        return False


def _module_names(declared: object) -> list[str] | None:
    """`target_modules` sorted; None unless it is a list of strings (a number or a list among them
    cannot be sorted with the names, nor put in a set)."""
    if not isinstance(declared, list) or not all(isinstance(m, str) for m in declared):
        return None
    return sorted(declared)


def _config_problems(config: dict[str, Any], pool: Pool, base_model: str) -> list[dict[str, Any]]:
    """What is wrong with adapter_config.json's peft_type, r, lora_alpha and target_modules."""
    problems: list[dict[str, Any]] = []
    rank, alpha, declared = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if config.get("peft_type") != "LORA":
        problems.append(_problem("peft_type", f"peft_type is {config.get('peft_type')!r}, not 'LORA'"))
    if not _whole_number(rank) or not 1 <= rank <= pool.max_rank:
        problems.append(
            _problem("r", f"rank r={rank!r} is outside [1, {pool.max_rank}] (the pool's max_rank)")
        )
    if not _finite_positive(alpha):
        problems.append(_problem("lora_alpha", f"lora_alpha={alpha!r} must be a finite number > 0"))
    modules = _module_names(declared)
    if modules is None:
        problems.append(_problem("target_modules", f"target_modules {declared!r} is not a list of names"))
        return problems
    unknown = sorted(set(modules) - set(pool.target_modules))
    if not modules or unknown:
        problems.append(
            _problem(
                "target_modules",
                f"target_modules {declared!r}: {unknown or 'none'} not adaptable by the pool of "
                f"{base_model!r} ({pool.target_modules})",
            )
        )
    return problems


def _weights_problems(
    header: dict[str, Any], pool: Pool, *, rank: object, modules: list[str]
) -> list[dict[str, Any]]:
    """What is wrong with the tensors: each a LoRA factor of an adaptable module, in a layer the model
    has, of the shape the rank and the module give; together adapting exactly `modules`."""
    assert pool.module_shapes is not None and pool.num_layers is not None  # checked by _check
    problems: list[dict[str, Any]] = []
    seen: set[str] = set()
    for name, info in header.items():
        if name == "__metadata__":
            continue
        m = _TENSOR.match(name)
        if m is None or m.group(2) not in pool.module_shapes:
            problems.append(
                _problem(ADAPTER_WEIGHTS, f"tensor {name!r} is not a LoRA factor of an adaptable module")
            )
            continue
        layer, module, factor = int(m.group(1)), m.group(2), m.group(3)
        seen.add(module)
        fan_in, fan_out = pool.module_shapes[module]
        want = [rank, fan_in] if factor == "A" else [fan_out, rank]
        if layer >= pool.num_layers:
            problems.append(
                _problem(ADAPTER_WEIGHTS, f"tensor {name!r}: layer {layer} >= the model's {pool.num_layers}")
            )
        elif info.get("dtype") not in FLOAT_DTYPES:
            problems.append(
                _problem(
                    ADAPTER_WEIGHTS,
                    f"tensor {name!r} has dtype {info.get('dtype')}, not floating point "
                    f"({', '.join(sorted(FLOAT_DTYPES))})",
                )
            )
        elif info.get("shape") != want:
            problems.append(
                _problem(
                    ADAPTER_WEIGHTS,
                    f"tensor {name!r} has shape {info.get('shape')}, expected {want} (r={rank})",
                )
            )
    if modules and seen and seen != set(modules):
        problems.append(
            _problem("target_modules", f"target_modules {modules} but the weights adapt {sorted(seen)}")
        )
    return problems


def _pairing_problems(header: dict[str, Any]) -> list[dict[str, Any]]:
    """A layer (the tensors' name before `.lora_A` / `.lora_B`) with one factor and not the other, or
    either twice. The shapes of a pair are checked by `_weights_problems`: each against the config's
    r and the module's dimensions, so the two agree when both pass. Checked here and not left to the
    pool, which refuses such an adapter only when a run starts from it."""
    factors: dict[str, list[str]] = {}
    for name in header:
        if _TENSOR.match(name) is not None:  # the others are refused by `_weights_problems`
            layer, _, rest = name.rpartition(".lora_")
            factors.setdefault(layer, []).append(f"lora_{rest[0]}")
    problems: list[dict[str, Any]] = []
    for layer, found in factors.items():
        if sorted(found) != ["lora_A", "lora_B"]:
            problems.append(
                _problem(
                    ADAPTER_WEIGHTS,
                    f"layer {layer!r} has {sorted(found)}: it needs one lora_A and one lora_B",
                )
            )
    return problems


def _nonfinite_problems(weights: Path) -> list[dict[str, Any]]:
    return [
        _problem(ADAPTER_WEIGHTS, f"tensor {name!r} holds NaN or infinite values")
        for name in nonfinite_tensors(weights)
    ]


def _check(
    staging: Path, *, base_model: str, session: Session
) -> tuple[int, float, list[str], list[dict[str, Any]]]:
    """(rank, alpha, target modules, problems) of the adapter in `staging`."""
    pool = live_pool(session, base_model=base_model)
    # The read ends before the weights are scanned (up to max_body_bytes): no lock (SQLite's write
    # lock) or connection is held meanwhile.
    session.commit()
    if pool is None or pool.module_shapes is None or pool.num_layers is None:
        raise ValidationFailed(
            f"no live pool serves {base_model!r} to check the adapter against; start one and upload again",
            code="no_pool",
        )
    config = json.loads((staging / ADAPTER_CONFIG).read_text())  # checked by extract_adapter_tar
    rank, alpha = config.get("r"), config.get("lora_alpha")
    modules = _module_names(config.get("target_modules")) or []
    header, _ = _read_safetensors_header(staging / ADAPTER_WEIGHTS)
    problems = (
        _config_problems(config, pool, base_model)
        + _weights_problems(header, pool, rank=rank, modules=modules)
        + _pairing_problems(header)
        + _nonfinite_problems(staging / ADAPTER_WEIGHTS)
    )
    return (
        rank if _whole_number(rank) else 0,
        float(alpha) if _finite_positive(alpha) else 0.0,
        modules,
        problems,
    )


def upload_adapter(
    session: Session, *, tenant_id: str, name: str, base_model: str, body: IO[bytes], settings: Settings
) -> TenantAdapter:
    """Check and store an uploaded adapter (an uncompressed tar of a PEFT directory).

    The quotas are checked twice: before the body is unpacked (a tenant at its limit costs nothing
    more), and exactly under the tenant's row lock just before the row is added, so that uploads
    at once cannot together take the tenant past them. The files are moved into place before the
    row is flushed, and removed again if the transaction does not commit."""
    _check_quota(session, tenant_id=tenant_id, settings=settings)
    # The read ends here: no lock (SQLite's write lock) or connection is held while the body is
    # unpacked, scanned and compressed.
    session.commit()
    root = uploads_dir(settings)
    root.mkdir(parents=True, exist_ok=True)
    staging, fd = _locked_staging(root)
    lock_fd: int | None = fd
    try:
        size, sha = extract_adapter_tar(body, staging, max_bytes=settings.max_body_bytes)
        rank, alpha, modules, problems = _check(staging, base_model=base_model, session=session)
        if problems:
            raise ValidationFailed(
                "the adapter does not fit the base model: " + "; ".join(p["msg"] for p in problems),
                code="invalid_adapter",
                details=problems,
            )
        with open(staging / ARCHIVE, "wb") as f:
            _write_archive(staging, f)
        stored = sum(p.stat().st_size for p in staging.iterdir())
        if not lock_tenant(session, tenant_id=tenant_id):
            raise NotFound(f"tenant {tenant_id} not found")  # deleted meanwhile (its keys with it)
        _check_quota(session, tenant_id=tenant_id, settings=settings, adding=stored)
        row = TenantAdapter(
            id=new_id("adp"),
            tenant_id=tenant_id,
            name=name,
            base_model=base_model,
            rank=rank,
            alpha=alpha,
            target_modules=modules,
            size_bytes=size,
            stored_bytes=stored,
            sha256=sha,
        )
        final = root / row.id
        _remove_unless_committed(session, final, fd)
        lock_fd = None  # released when the transaction ends
        staging.rename(final)
        session.add(row)
        session.flush()
        return row
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        shutil.rmtree(staging, ignore_errors=True)  # gone already once moved into place


def _locked_staging(root: Path) -> tuple[Path, int]:
    """A new staging directory under `root`, and a descriptor holding a shared flock on it (moved
    into place, the directory keeps it): `remove_orphan_uploads` leaves a locked directory alone.
    Another process's clean-up may remove a staging directory between its creation and the lock;
    then another one is made."""
    for _ in range(3):
        staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root))
        try:
            fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(staging).st_ino == os.fstat(fd).st_ino:
                return staging, fd
        os.close(fd)
    raise OSError(f"could not make a staging directory under {root}")


# ---------------------------------------------------------------- files of uncommitted rows

_PLACED = "loraloom.placed_uploads"


@dataclass
class _Placed:
    directory: Path
    lock_fd: int
    committed: bool = False


def _remove_unless_committed(session: Session, directory: Path, lock_fd: int) -> None:
    """Remove `directory` when the session's transaction ends without committing (the row never
    kept: a failed flush or commit, an error after the upload); release `lock_fd` either way."""
    placed: list[_Placed] | None = session.info.get(_PLACED)
    if placed is None:
        placed = session.info[_PLACED] = []
        event.listen(session, "after_commit", _mark_committed)
        event.listen(session, "after_transaction_end", _settle_placed)
    placed.append(_Placed(directory, lock_fd))


def _mark_committed(session: Session) -> None:
    if session.in_nested_transaction():  # a savepoint released; the real commit is still to come
        return
    for p in session.info.get(_PLACED, []):
        p.committed = True


def _settle_placed(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is not None:  # a savepoint's end, not the transaction's
        return
    placed: list[_Placed] = session.info.get(_PLACED, [])
    todo, placed[:] = list(placed), []
    for p in todo:
        if not p.committed:
            shutil.rmtree(p.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(p.lock_fd)


def remove_upload_dirs(adapter_ids: list[str], settings: Settings) -> None:
    """Remove the files of uploaded adapters whose rows are gone (after the commit that removed them)."""
    for adapter_id in adapter_ids:
        shutil.rmtree(uploads_dir(settings) / adapter_id, ignore_errors=True)


def remove_orphan_uploads(session: Session, *, settings: Settings) -> int:
    """Delete the directories under `{data_dir}/adapters/` no row references (start-up clean-up):
    staging leftovers, and uploads moved into place whose commit never came (a crash in between),
    but never one an upload in progress holds, in this process or another (see `_locked_staging`).
    Returns how many were removed."""
    root = uploads_dir(settings)
    if not root.is_dir():
        return 0
    kept = set(session.scalars(select(TenantAdapter.id)))
    removed = 0
    for path in sorted(root.iterdir()):
        is_upload = _ADAPTER_ID.fullmatch(path.name) is not None
        if path.name in kept or not (is_upload or path.name.startswith(STAGING_PREFIX)):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or not a directory
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # an upload holds it: its row is being committed
            # Unlocked: its upload's transaction has ended. Ask again (a fresh statement): it may
            # have committed since the set above was read.
            if is_upload and session.scalar(select(exists().where(TenantAdapter.id == path.name))):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d uploaded adapter directories without a row under %s", removed, root)
    return removed


def _kept_of(session: Session, tenant_id: str) -> tuple[int, int]:
    """The tenant's uploaded adapters and the bytes they take on disk."""
    count, stored = session.execute(
        select(func.count(), func.coalesce(func.sum(TenantAdapter.stored_bytes), 0)).where(
            TenantAdapter.tenant_id == tenant_id
        )
    ).one()
    return int(count), int(stored)


def _check_quota(session: Session, *, tenant_id: str, settings: Settings, adding: int | None = None) -> None:
    """409 when the tenant keeps `tenant_max_adapters` already, or when an upload that takes `adding`
    bytes on disk (measured once written) would take its uploads past `tenant_max_adapter_bytes`
    (`adding` unknown yet: when they reach it already). Exact under the tenant's row lock
    (`lock_tenant`, until the commit); without it, uploads at once may all pass."""
    kept, stored = _kept_of(session, tenant_id)
    if kept >= settings.tenant_max_adapters:
        raise Conflict(
            f"this tenant keeps {kept} uploaded adapters (limit {settings.tenant_max_adapters}); "
            "delete one (DELETE /v1/adapters/{id}) first",
            code="adapter_quota",
            details={"adapters": kept, "limit": settings.tenant_max_adapters},
        )
    limit = settings.tenant_max_adapter_bytes
    if stored >= limit if adding is None else stored + adding > limit:
        raise _bytes_over_quota(stored, settings=settings, adding=adding)


def _bytes_over_quota(stored: int, *, settings: Settings, adding: int | None = None) -> Conflict:
    limit = settings.tenant_max_adapter_bytes
    this_one = "" if adding is None else f"; this one would add {adding}"
    details = {"bytes": stored, "limit_bytes": limit} | ({} if adding is None else {"upload_bytes": adding})
    return Conflict(
        f"this tenant's uploaded adapters take {stored} bytes on disk (limit {limit}){this_one}; "
        "delete one (DELETE /v1/adapters/{id}) first",
        code="adapter_quota",
        details=details,
    )


def get_tenant_adapter(session: Session, *, tenant_id: str, adapter_id: str) -> TenantAdapter:
    """The tenant's adapter; another tenant's is reported exactly like a missing one."""
    row = session.get(TenantAdapter, adapter_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"adapter {adapter_id} not found", code="adapter_not_found")
    return row


def list_tenant_adapters(session: Session, *, tenant_id: str) -> list[TenantAdapter]:
    query = (
        select(TenantAdapter).where(TenantAdapter.tenant_id == tenant_id).order_by(TenantAdapter.created_at)
    )
    return list(session.scalars(query))


def delete_tenant_adapter(session: Session, *, tenant_id: str, adapter_id: str, settings: Settings) -> None:
    row = get_tenant_adapter(session, tenant_id=tenant_id, adapter_id=adapter_id)
    session.delete(row)
    session.flush()
    # Not before the commit: a rolled-back deletion keeps its row, which needs its files.
    call_after_commit(session, lambda: remove_upload_dirs([adapter_id], settings))


def open_archive(adapter_id: str, settings: Settings) -> BinaryIO:
    """The uploaded adapter's tar.gz, open for reading: read whole even if it is deleted meanwhile."""
    if _ADAPTER_ID.fullmatch(adapter_id) is None:  # it becomes a path
        raise NotFound(f"adapter {adapter_id} has no files", code="adapter_not_found")
    try:
        return open(uploads_dir(settings) / adapter_id / ARCHIVE, "rb")
    except FileNotFoundError:
        raise NotFound(f"adapter {adapter_id} has no files", code="adapter_not_found") from None
