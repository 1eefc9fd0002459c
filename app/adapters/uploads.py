"""Adapters a tenant uploads (POST /v1/adapters) to start runs from: checked against the live pool of
their base model (rank limit, target modules, every tensor's shape), stored once under
``{data_dir}/adapters/{id}/``, tenant-scoped, listable and deletable. An upload that fails any check
is a 422 naming what is wrong, and nothing of it is kept."""

import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any, TypeGuard

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.adapters.models import TenantAdapter
from app.adapters.service import _write_archive
from app.adapters.upload import _read_safetensors_header, extract_adapter_tar, nonfinite_tensors
from app.config import Settings
from app.errors import Conflict, NotFound, ValidationFailed
from app.pools.models import Pool
from app.runs.admission import live_pool
from contracts.ids import new_id
from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

ARCHIVE = "adapter.tar.gz"
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
    """Check and store an uploaded adapter (an uncompressed tar of a PEFT directory)."""
    _check_quota(session, tenant_id=tenant_id, settings=settings)
    root = uploads_dir(settings)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".upload_", dir=root))
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
        _check_byte_quota(session, tenant_id=tenant_id, adding=stored, settings=settings)
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
        staging.rename(root / row.id)
        session.add(row)
        session.flush()
        return row
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _kept_of(session: Session, tenant_id: str) -> tuple[int, int]:
    """The tenant's uploaded adapters and the bytes they take on disk."""
    count, stored = session.execute(
        select(func.count(), func.coalesce(func.sum(TenantAdapter.stored_bytes), 0)).where(
            TenantAdapter.tenant_id == tenant_id
        )
    ).one()
    return int(count), int(stored)


def _check_quota(session: Session, *, tenant_id: str, settings: Settings) -> None:
    """409 before the body is unpacked when the tenant keeps `tenant_max_adapters` already, or its
    uploads take `tenant_max_adapter_bytes` (a bound: two uploads at once may both pass it)."""
    kept, stored = _kept_of(session, tenant_id)
    if kept >= settings.tenant_max_adapters:
        raise Conflict(
            f"this tenant keeps {kept} uploaded adapters (limit {settings.tenant_max_adapters}); "
            "delete one (DELETE /v1/adapters/{id}) first",
            code="adapter_quota",
            details={"adapters": kept, "limit": settings.tenant_max_adapters},
        )
    if stored >= settings.tenant_max_adapter_bytes:
        raise _bytes_over_quota(stored, settings=settings)


def _check_byte_quota(session: Session, *, tenant_id: str, adding: int, settings: Settings) -> None:
    """409 when an upload that takes `adding` bytes on disk (measured once written, before it is
    kept) would take the tenant's uploads past `tenant_max_adapter_bytes`."""
    _, stored = _kept_of(session, tenant_id)
    if stored + adding > settings.tenant_max_adapter_bytes:
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
    shutil.rmtree(uploads_dir(settings) / adapter_id, ignore_errors=True)


def archive_path(adapter_id: str, settings: Settings) -> Path:
    path = uploads_dir(settings) / adapter_id / ARCHIVE
    if not path.is_file():
        raise NotFound(f"adapter {adapter_id} has no files", code="adapter_not_found")
    return path
