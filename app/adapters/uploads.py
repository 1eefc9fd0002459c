"""Adapters a tenant uploads (POST /v1/adapters) to start runs from: checked against the live pool of
their base model (rank limit, target modules, every tensor's shape), stored once under
``{data_dir}/adapters/{id}/``, tenant-scoped, listable and deletable. An upload that fails any check
is a 422 naming what is wrong, and nothing of it is kept."""

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.adapters.models import TenantAdapter
from app.adapters.service import _write_archive
from app.adapters.upload import _read_safetensors_header, extract_adapter_tar
from app.config import Settings
from app.errors import NotFound, ValidationFailed
from app.runs.admission import live_pool
from contracts.ids import new_id
from contracts.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS

ARCHIVE = "adapter.tar.gz"
_TENSOR = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:[a-z_]+\.)?([a-z_]+)\.lora_([AB])(?:\.weight)?$")


def uploads_dir(settings: Settings) -> Path:
    return settings.data_dir / "adapters"


def _problem(field: str, message: str) -> dict[str, Any]:
    return {"loc": ["body", field], "msg": message}


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
    config = json.loads((staging / ADAPTER_CONFIG).read_text())
    problems: list[dict[str, Any]] = []
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if config.get("peft_type") != "LORA":
        problems.append(_problem("peft_type", f"peft_type is {config.get('peft_type')!r}, not 'LORA'"))
    if not isinstance(rank, int) or not 1 <= rank <= pool.max_rank:
        problems.append(
            _problem("r", f"rank r={rank!r} is outside [1, {pool.max_rank}] (the pool's max_rank)")
        )
    if not isinstance(alpha, (int, float)) or not alpha > 0:
        problems.append(_problem("lora_alpha", f"lora_alpha={alpha!r} must be a number > 0"))
    declared = config.get("target_modules")
    modules = sorted(declared) if isinstance(declared, list) else []
    unknown = sorted(set(modules) - set(pool.target_modules))
    if not modules or unknown:
        problems.append(
            _problem(
                "target_modules",
                f"target_modules {declared!r}: {unknown or 'none'} not adaptable by the pool of "
                f"{base_model!r} ({pool.target_modules})",
            )
        )
    header, _ = _read_safetensors_header(staging / ADAPTER_WEIGHTS)
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
    return int(rank) if isinstance(rank, int) else 0, float(alpha or 0.0), modules, problems


def upload_adapter(
    session: Session, *, tenant_id: str, name: str, base_model: str, body: IO[bytes], settings: Settings
) -> TenantAdapter:
    """Check and store an uploaded adapter (an uncompressed tar of a PEFT directory)."""
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
        row = TenantAdapter(
            id=new_id("adp"),
            tenant_id=tenant_id,
            name=name,
            base_model=base_model,
            rank=rank,
            alpha=alpha,
            target_modules=modules,
            size_bytes=size,
            sha256=sha,
        )
        with open(staging / ARCHIVE, "wb") as f:
            _write_archive(staging, f)
        staging.rename(root / row.id)
        session.add(row)
        session.flush()
        return row
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
