"""`init_from` of POST /v1/runs: which adapter a new run starts from, checked against the new run's config.

Resolved once, at creation: "latest" becomes the source's newest adapter step then, so the new run
starts from the same weights however long it waits in the queue. The pool downloads that adapter
(GET /v1/pool/runs/{run_id}/init-adapter) and loads it into the run's slot when the run has no
checkpoint yet.
"""

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.adapters.models import Adapter, Checkpoint, TenantAdapter
from app.errors import NotFound, ValidationFailed
from app.runs.models import Run
from app.runs.schemas import InitFromRun
from contracts.run_config import RunConfig
from contracts.status import RunStatus


def resolve_init_from(
    session: Session, *, tenant_id: str, request: InitFromRun, config: RunConfig
) -> dict[str, Any]:
    """{"run_id", "step"} of the adapter to start from. A run of another tenant, or a deleted one, is
    a 404 exactly like a missing one; a missing adapter step is a 404; an adapter that does not fit
    `config` is a 422 that names every mismatching field."""
    if request.adapter_id is not None:
        return _uploaded(session, tenant_id=tenant_id, adapter_id=request.adapter_id, config=config)
    source = session.get(Run, request.run_id) if request.run_id is not None else None
    # A deleted run's row stays a while (app/retention.py), its adapter and checkpoint rows with it, but
    # its files are gone: the pool could only evict the new run once it tried to load them.
    if source is None or source.tenant_id != tenant_id or source.status == RunStatus.DELETED:
        raise NotFound(f"run {request.run_id} not found (init_from.run_id)")
    if request.checkpoint is not None:
        found = _checkpoint_step(session, source.id, request.checkpoint)
        resolved: dict[str, Any] = {
            "run_id": source.id,
            "checkpoint": found,
            "with_optimizer": request.with_optimizer,
        }
        what = f"checkpoint {found}"
    else:
        found = _adapter_step(session, source.id, "latest" if request.step is None else request.step)
        resolved = {"run_id": source.id, "step": found}
        what = f"step {found}"
    theirs = RunConfig.model_validate(source.config)
    compared: list[tuple[str, Any, Any]] = [
        ("base_model", config.base_model, theirs.base_model),
        ("lora.rank", config.lora.rank, theirs.lora.rank),
        ("lora.alpha", config.lora.alpha, theirs.lora.alpha),
        ("lora.target_modules", sorted(config.lora.target_modules), sorted(theirs.lora.target_modules)),
    ]
    if request.with_optimizer:
        # The optimizer state is per parameter and carries the source's hyperparameters and schedule.
        compared += [
            ("optim", config.optim.model_dump(), theirs.optim.model_dump()),
            ("scheduler", config.scheduler.model_dump(), theirs.scheduler.model_dump()),
        ]
    _refuse_mismatches(compared, f"the init_from source (run {source.id} {what})")
    return resolved


def _refuse_mismatches(compared: list[tuple[str, Any, Any]], source: str) -> None:
    """A 422 naming each field of the new run's config that differs from `source`'s, one `{loc, msg,
    type}` item each (README "Errors"), `loc` the field's path in the create body."""
    mismatches = [(field, mine, other) for field, mine, other in compared if mine != other]
    if not mismatches:
        return
    details: list[dict[str, Any]] = [
        {
            "loc": ["body", "config", *field.split(".")],
            "msg": f"{field} is {mine!r} but {source} has {other!r}",
            "type": "init_from_mismatch",
        }
        for field, mine, other in mismatches
    ]
    raise ValidationFailed(
        "the init_from adapter does not fit this run's config: " + "; ".join(d["msg"] for d in details),
        details=details,
    )


def _uploaded(session: Session, *, tenant_id: str, adapter_id: str, config: RunConfig) -> dict[str, Any]:
    # Read under the tenant's row lock, which the caller holds to its commit (create_run), as the
    # adapter's deletion does: an adapter deleted meanwhile is a 404 here, or the deletion sees this
    # run and is refused (app/adapters/uploads.py delete_tenant_adapter).
    row = session.get(TenantAdapter, adapter_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"adapter {adapter_id} not found (init_from.adapter_id)", code="adapter_not_found")
    compared: list[tuple[str, Any, Any]] = [
        ("base_model", config.base_model, row.base_model),
        ("lora.rank", config.lora.rank, row.rank),
        ("lora.alpha", config.lora.alpha, row.alpha),
        ("lora.target_modules", sorted(config.lora.target_modules), sorted(row.target_modules)),
    ]
    _refuse_mismatches(compared, f"the uploaded adapter {adapter_id}")
    return {"adapter_id": adapter_id}


def _adapter_step(session: Session, run_id: str, step: int | str) -> int:
    # Not app.adapters.service.get_adapter: that module imports the runs service (a cycle).
    query = select(Adapter.step).where(Adapter.run_id == run_id)
    query = (
        query.order_by(Adapter.step.desc()).limit(1)
        if step == "latest"
        else query.where(Adapter.step == step)
    )
    found = session.scalar(query)
    if found is None:
        what = "no adapter yet" if step == "latest" else f"no adapter for step {step}"
        raise NotFound(f"run {run_id} has {what} (init_from)", code="adapter_not_found")
    return int(found)


def _checkpoint_step(session: Session, run_id: str, step: int | str) -> int:
    query = select(Checkpoint.step).where(Checkpoint.run_id == run_id)
    query = (
        query.order_by(Checkpoint.step.desc()).limit(1)
        if step == "latest"
        else query.where(Checkpoint.step == step)
    )
    found = session.scalar(query)
    if found is None:
        what = "no checkpoint yet" if step == "latest" else f"no checkpoint of step {step}"
        raise NotFound(f"run {run_id} has {what} (init_from)", code="checkpoint_not_found")
    return int(found)
