"""`init_from` of POST /v1/runs: which adapter a new run starts from, checked against the new run's config.

Resolved once, at creation: "latest" becomes the source's newest adapter step then, so the new run
starts from the same weights however long it waits in the queue. The pool downloads that adapter
(GET /v1/pool/runs/{run_id}/init-adapter) and loads it into the run's slot when the run has no
checkpoint yet.
"""

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.adapters.models import Adapter
from app.errors import NotFound, ValidationFailed
from app.runs.models import Run
from app.runs.schemas import InitFromRun
from contracts.run_config import RunConfig


def resolve_init_from(
    session: Session, *, tenant_id: str, request: InitFromRun, config: RunConfig
) -> dict[str, Any]:
    """{"run_id", "step"} of the adapter to start from. A run of another tenant is a 404 exactly like a
    missing one; a missing adapter step is a 404; an adapter that does not fit `config` is a 422 that
    names every mismatching field."""
    source = session.get(Run, request.run_id)
    if source is None or source.tenant_id != tenant_id:
        raise NotFound(f"run {request.run_id} not found (init_from.run_id)")
    # Not app.adapters.service.get_adapter: that module imports the runs service (a cycle).
    query = select(Adapter).where(Adapter.run_id == source.id)
    if request.step == "latest":
        query = query.order_by(Adapter.step.desc()).limit(1)
    else:
        query = query.where(Adapter.step == request.step)
    adapter = session.scalar(query)
    if adapter is None:
        what = "no adapter yet" if request.step == "latest" else f"no adapter for step {request.step}"
        raise NotFound(f"run {source.id} has {what} (init_from)", code="adapter_not_found")
    theirs = RunConfig.model_validate(source.config)
    mismatches = [
        (field, mine, other)
        for field, mine, other in (
            ("base_model", config.base_model, theirs.base_model),
            ("lora.rank", config.lora.rank, theirs.lora.rank),
            ("lora.alpha", config.lora.alpha, theirs.lora.alpha),
            ("lora.target_modules", sorted(config.lora.target_modules), sorted(theirs.lora.target_modules)),
        )
        if mine != other
    ]
    if mismatches:
        messages = [
            f"{field} is {mine!r} but the init_from adapter (run {source.id} step {adapter.step}) has {other!r}"
            for field, mine, other in mismatches
        ]
        details: list[dict[str, Any]] = [
            {
                "loc": ["body", "config", *field.split(".")],
                "msg": message,
            }
            for (field, _, _), message in zip(mismatches, messages, strict=True)
        ]
        raise ValidationFailed(
            "the init_from adapter does not fit this run's config: " + "; ".join(messages),
            details=details,
        )
    return {"run_id": source.id, "step": adapter.step}
