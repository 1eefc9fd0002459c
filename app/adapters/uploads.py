"""Adapters a tenant uploads (POST /v1/adapters) to start runs from: checked by the pool's own import
rules (contracts/peft.py) against the live pool of their base model (rank limit, target modules,
every tensor's name, dtype and shape), stored once under
``{data_dir}/adapters/{id}/``, tenant-scoped, listable and deletable. An upload that fails any check
is a 422 naming what is wrong, and nothing of it is kept."""

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from sqlalchemy import and_, event, exists, func, or_, select
from sqlalchemy.orm import Session, SessionTransaction

from app.adapters.models import Checkpoint, TenantAdapter
from app.adapters.service import _write_archive
from app.adapters.upload import _read_safetensors_header, extract_adapter_tar, nonfinite_tensors
from app.config import Settings
from app.errors import Conflict, NotFound, ValidationFailed
from app.events.after_commit import call_after_commit
from app.pools.models import Pool
from app.projection import remove_tree
from app.runs.admission import live_pool
from app.runs.models import Run
from app.tenants.service import lock_tenant
from contracts.ids import new_id
from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from contracts.peft import (
    ModuleDims,
    adapter_problems,
    config_problems,
    finite_positive,
    shown,
    split_factor,
    too_many_tensors,
    whole_number,
)
from contracts.status import RunStatus

log = logging.getLogger(__name__)

ARCHIVE = "adapter.tar.gz"
STAGING_PREFIX = ".upload_"
"""Under `{data_dir}/adapters/`: an upload being unpacked and checked, before it is moved into place."""
_ADAPTER_ID = re.compile(r"adp_[0-9a-f]{12}")
# A module (a tensor's name between PEFT's prefix and `.lora_A.weight`, contracts/peft.py) in a
# numbered layer. A layer index of at most 9 ASCII digits: int() of thousands of digits raises, and
# `\d` takes any script's digits.
_MODULE = re.compile(r"^(?:.*\.)?layers\.([0-9]{1,9})\.(?:[a-z_]+\.)?([a-z_]+)$")


def uploads_dir(settings: Settings) -> Path:
    return settings.data_dir / "adapters"


MAX_LISTED_PROBLEMS = 20
"""At most this many problems in an `invalid_adapter` refusal's details, and one more counting the rest
(`_capped`): an adapter of thousands of wrong tensors was listed one problem each, a 331 MB 422."""

MAX_NAMED_RUNS = 20
"""At most this many run ids in an `adapter_in_use` refusal's details (`runs` counts them all)."""


class AdapterInUse(Conflict):
    """409: a run that has not loaded its `init_from` weights yet starts from this uploaded adapter."""

    code = "adapter_in_use"


def _problem(field: str, message: str, kind: str) -> dict[str, Any]:
    """One item of an `invalid_adapter` 422's details (README "Errors": `{loc, msg, type}`)."""
    return {"loc": ["body", field], "msg": message, "type": kind}


def _capped(problems: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first MAX_LISTED_PROBLEMS problems, and one item counting the rest."""
    if len(problems) <= MAX_LISTED_PROBLEMS:
        return problems
    rest = len(problems) - MAX_LISTED_PROBLEMS
    return [
        *problems[:MAX_LISTED_PROBLEMS],
        {"loc": ["body"], "msg": f"and {rest} more problems, not listed", "type": "more_problems"},
    ]


def _shared_problem_type(field: str) -> str:
    """The `type` of a problem contracts/peft.py found (it names the field only)."""
    if field == ADAPTER_WEIGHTS:
        return "adapter_weights_mismatch"  # a tensor's name, module, dtype or shape
    if field == "body":
        return "adapter_config_not_object"
    return "adapter_config_invalid"  # the key of adapter_config.json is the loc's last part


def _module_names(declared: object) -> list[str] | None:
    """`target_modules` sorted; None unless it is a list of strings (a number or a list among them
    cannot be sorted with the names, nor put in a set)."""
    if not isinstance(declared, list) or not all(isinstance(m, str) for m in declared):
        return None
    return sorted(declared)


def _pool_dims(pool: Pool, base_model: str) -> ModuleDims:
    """The modules of the pool's model as the service knows them: the adaptable module types with
    their features, and the number of layers (what the pool registered). A module is a known type in
    a layer the model has (`...layers.<N>.[<block>.]<type>`). The rest of its path (which parent holds
    the layers, which block holds the module) the service cannot know: a path the model does not have
    is refused by the pool, when a run starts from the adapter (trainer_core/export.py)."""
    assert pool.module_shapes is not None and pool.num_layers is not None  # checked by _pool_to_check_against
    shapes, num_layers = pool.module_shapes, pool.num_layers

    def dims(module: str) -> tuple[int, int] | str:
        m = _MODULE.match(module)
        if m is None or m.group(2) not in shapes:
            return (
                f"its module {shown(module)} is not one the pool of {base_model!r} adapts "
                f"(...layers.<N>.<one of {sorted(shapes)}>)"
            )
        layer = int(m.group(1))
        if layer >= num_layers:
            return f"layer {layer} >= the model's {num_layers}"
        fan_in, fan_out = shapes[m.group(2)]
        return fan_in, fan_out

    return dims


def _pool_tensor_limit(pool: Pool) -> int:
    """The most tensors an adapter of the pool's model can have: a lora_A and a lora_B for each module
    type it adapts (what it registered the features of) in each of its layers (`_pool_dims` refuses
    any other module)."""
    assert pool.module_shapes is not None and pool.num_layers is not None  # checked by _pool_to_check_against
    return 2 * len(pool.module_shapes) * pool.num_layers


def _declared_modules_problems(config: dict[str, Any], pool: Pool, base_model: str) -> list[dict[str, Any]]:
    """`target_modules` as the config declares it: a non-empty list of modules the pool adapts (the
    config alone: no tensor looked at)."""
    declared = config.get("target_modules")
    modules = _module_names(declared)
    if modules is None:
        return [
            _problem(
                "target_modules",
                f"target_modules {shown(declared)} is not a list of names",
                "adapter_config_invalid",
            )
        ]
    unknown = sorted(set(modules) - set(pool.target_modules))
    if not modules or unknown:
        return [
            _problem(
                "target_modules",
                f"target_modules {shown(declared)}: {shown(unknown) if unknown else 'none'} not "
                f"adaptable by the pool of {base_model!r} ({pool.target_modules})",
                "target_modules_not_adaptable",
            )
        ]
    return []


def _target_modules_problems(
    config: dict[str, Any], header: dict[str, Any], pool: Pool, base_model: str
) -> list[dict[str, Any]]:
    """`target_modules`: a non-empty list of modules the pool adapts, exactly those the weights adapt
    (the run that starts from the adapter must declare the same; app/runs/init_from.py)."""
    declared_problems = _declared_modules_problems(config, pool, base_model)
    if declared_problems:
        return declared_problems
    modules = _module_names(config.get("target_modules")) or []
    seen: set[str] = set()
    for name in header:
        split = split_factor(name)
        m = _MODULE.match(split[0]) if split is not None else None
        if m is not None and m.group(2) in (pool.module_shapes or {}):
            seen.add(m.group(2))
    if seen and seen != set(modules):
        return [
            _problem(
                "target_modules",
                f"target_modules {sorted(set(modules))} but the weights adapt {sorted(seen)}",
                "target_modules_mismatch",
            )
        ]
    return []


def _nonfinite_problems(weights: Path) -> list[dict[str, Any]]:
    return [
        _problem(ADAPTER_WEIGHTS, f"tensor {name!r} holds NaN or infinite values", "non_finite_tensor")
        for name in nonfinite_tensors(weights)
    ]


def _pool_to_check_against(session: Session, *, base_model: str) -> Pool:
    """The live pool of `base_model`, which an upload is checked against; the 422 `no_pool` when
    none serves it (or one registered without its model's modules: nothing to check against)."""
    pool = live_pool(session, base_model=base_model)
    if pool is None or pool.module_shapes is None or pool.num_layers is None:
        message = (
            f"no live pool serves {base_model!r} to check the adapter against; start one and upload again"
        )
        raise ValidationFailed(
            message,
            code="no_pool",
            details=[{"loc": ["query", "base_model"], "msg": message, "type": "no_pool"}],
        )
    return pool


def _check(
    staging: Path, *, pool: Pool, base_model: str
) -> tuple[int, float, list[str], list[dict[str, Any]]]:
    """(rank, alpha, target modules, problems) of the adapter in `staging`, against `pool`
    (`_pool_to_check_against`)."""
    config = json.loads((staging / ADAPTER_CONFIG).read_text())  # checked by extract_adapter_tar
    rank, alpha = config.get("r"), config.get("lora_alpha")
    modules = _module_names(config.get("target_modules")) or []
    header, _ = _read_safetensors_header(staging / ADAPTER_WEIGHTS)
    header.pop("__metadata__", None)
    # Counted before any tensor is looked at: what the pool's model can hold bounds the work.
    limit = _pool_tensor_limit(pool)
    if len(header) > limit:
        message = too_many_tensors(len(header), limit, of=f"an adapter of the pool of {base_model!r}")
        problems = [
            _problem(p.field, p.message, _shared_problem_type(p.field))
            for p in config_problems(config, max_rank=pool.max_rank)
        ] + [
            # What the config declares still says why (a module the pool does not adapt), unread tensors aside.
            *_declared_modules_problems(config, pool, base_model),
            _problem(ADAPTER_WEIGHTS, message, "too_many_tensors"),
        ]
    else:
        # The pool's own import rules (contracts/peft.py), with what the service knows of its model.
        shared = adapter_problems(config, header, max_rank=pool.max_rank, dims=_pool_dims(pool, base_model))
        problems = (
            [_problem(p.field, p.message, _shared_problem_type(p.field)) for p in shared]
            + _target_modules_problems(config, header, pool, base_model)
            + _nonfinite_problems(staging / ADAPTER_WEIGHTS)
        )
    return (
        rank if whole_number(rank) else 0,
        float(alpha) if finite_positive(alpha) else 0.0,
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
    # Refusals that need nothing of the body come before it is unpacked, in this order: the tenant's
    # quota (409 `adapter_quota`), then a live pool to check against (422 `no_pool`); then the tar's
    # own problems (422 `invalid_adapter`, 413) and what the pool refuses of it. `no_pool` came after
    # the tar was unpacked and its safetensors header parsed: work (up to max_body_bytes) for an
    # upload no body could make succeed, and a malformed tar got `invalid_adapter`, then, fixed,
    # `no_pool`. The pool's PUT refuses its run's state before the tar alike (service.store_adapter).
    _check_quota(session, tenant_id=tenant_id, settings=settings)
    pool = _pool_to_check_against(session, base_model=base_model)
    # The read ends here: no lock (SQLite's write lock) or connection is held while the body is
    # unpacked, scanned and compressed (the pool's row is kept as read: expire_on_commit=False).
    session.commit()
    root = uploads_dir(settings)
    root.mkdir(parents=True, exist_ok=True)
    staging, fd = _locked_staging(root)
    lock_fd: int | None = fd
    try:
        size, sha = extract_adapter_tar(body, staging, max_bytes=settings.max_body_bytes)
        rank, alpha, modules, problems = _check(staging, pool=pool, base_model=base_model)
        if problems:
            listed = _capped(problems)
            raise ValidationFailed(
                "the adapter does not fit the base model: " + "; ".join(p["msg"] for p in listed),
                code="invalid_adapter",
                details=listed,
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


def is_upload_dir_name(name: str) -> bool:
    """Whether a name under `{data_dir}/adapters/` is an upload's: an adapter's directory (its id),
    or a staging one (`_locked_staging`)."""
    return _ADAPTER_ID.fullmatch(name) is not None or name.startswith(STAGING_PREFIX)


def remove_orphan_uploads(session: Session, *, settings: Settings) -> int:
    """Delete the directories under `{data_dir}/adapters/` no row references (start-up clean-up):
    staging leftovers, and uploads moved into place whose commit never came (a crash in between),
    but never one an upload in progress holds (`remove_if_unheld`). Returns how many were removed."""
    root = uploads_dir(settings)
    if not root.is_dir():
        return 0
    kept = set(session.scalars(select(TenantAdapter.id)))
    names = sorted(n for n in os.listdir(root) if is_upload_dir_name(n) and n not in kept)
    removed = 0
    for name in names:
        try:
            removed += remove_if_unheld(session, root / name)
        except OSError:  # the start-up goes on; the sweeper's reconcile pass tries again
            log.exception("could not remove the uploaded adapter directory %s", root / name)
    if removed:
        log.info("removed %d uploaded adapter directories without a row under %s", removed, root)
    return removed


def remove_if_unheld(session: Session, path: Path) -> bool:
    """Delete an upload's directory found without a row, unless an upload holds it (its flock), in
    this process or another (see `_locked_staging`), or, asked again once none can, its row has been
    committed meanwhile. Returns whether this call removed it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone meanwhile, or not a directory
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # an upload holds it: its row is being committed
        # Unlocked: its upload's transaction has ended. Ask again (a fresh statement): it may have
        # committed since the caller found no row.
        if _ADAPTER_ID.fullmatch(path.name) and session.scalar(
            select(exists().where(TenantAdapter.id == path.name))
        ):
            return False
        return remove_tree(path)
    finally:
        os.close(fd)


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


def runs_starting_from(session: Session, *, tenant_id: str, adapter_id: str) -> list[str]:
    """The tenant's runs that may still load the uploaded adapter, oldest first: the queued ones, and
    the active ones without a checkpoint of their own. The pool loads `init_from` weights whenever it
    admits a run that has no checkpoint yet (trainer_core/init_from.py): a pool restarted, or the run
    admitted again, before its first checkpoint loads them again. Once a run has a checkpoint it
    resumes from it, and a finished run is never admitted again."""
    has_checkpoint = exists().where(Checkpoint.run_id == Run.id)
    query = (
        select(Run.id)
        .where(
            Run.tenant_id == tenant_id,
            Run.init_from["adapter_id"].as_string() == adapter_id,
            or_(Run.status == RunStatus.QUEUED, and_(Run.status == RunStatus.ACTIVE, ~has_checkpoint)),
        )
        .order_by(Run.created_at, Run.id)
    )
    return list(session.scalars(query))


def delete_tenant_adapter(session: Session, *, tenant_id: str, adapter_id: str, settings: Settings) -> None:
    """Delete the tenant's uploaded adapter and (after the commit) its files; a 409 `adapter_in_use`
    naming the runs that still start from it (`runs_starting_from`): deleted, they were evicted by the
    pool once admitted ("has no files")."""
    # The tenant's row first. A run's creation holds it from before it resolves `init_from` to its
    # commit (app/runs/service.py create_run): the runs read below include every run created from
    # this adapter, or that creation waits, then reads the adapter after this deletion (a 404). On
    # SQLite every transaction holds the database's write lock from its first statement.
    lock_tenant(session, tenant_id=tenant_id)
    row = get_tenant_adapter(session, tenant_id=tenant_id, adapter_id=adapter_id)
    users = runs_starting_from(session, tenant_id=tenant_id, adapter_id=adapter_id)
    if users:
        named = ", ".join(users[:MAX_NAMED_RUNS]) + (" ..." if len(users) > MAX_NAMED_RUNS else "")
        raise AdapterInUse(
            f"adapter {adapter_id} is the init_from of {len(users)} run(s) that have not loaded it yet "
            f"({named}): delete or evict them, or wait until each has its first checkpoint, then "
            "delete the adapter",
            details={"run_ids": users[:MAX_NAMED_RUNS], "runs": len(users)},
        )
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
