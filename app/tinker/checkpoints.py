"""The checkpoints of Tinker models (the SDK's RestClient): list a model's, list the tenant's,
delete one, and what a `tinker://` path loads into. Keyword-only, raises domain errors, never
commits.

A checkpoint is what a completed save named: `save_state` → a training checkpoint
`tinker://<model>/weights/<name>` (adapter and optimizer state on the pool), and
`save_weights_for_sampler` → a sampler checkpoint `tinker://<model>/sampler_weights/<name>` (the
run's adapter of that step). A name saved again names the newest save. Deleting one forgets the
name: its path no longer lists, loads, resolves or samples; the run's adapters stay the run's
(`/v1/runs/{id}/adapters`) and a saved state stays on the pool's disk until the run is deleted.
Another tenant's models and paths are reported exactly like missing ones (404).
"""

from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import NotFound, ValidationFailed
from app.runs.models import Run
from app.tinker.models import CHECKPOINT_DELETED, TinkerFuture, TinkerModel
from app.tinker.schemas import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    CheckpointOut,
    TrainingRunOut,
    WeightsInfoOut,
)
from app.tinker.service import get_model
from contracts.status import RunStatus

CheckpointType = Literal["training", "sampler"]
TYPE_OF_KIND: dict[str, CheckpointType] = {"save_weights": "training", "save_weights_for_sampler": "sampler"}
KIND_OF_SEGMENT = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler"}


def _saves(session: Session, *, tenant_id: str, model_id: str | None = None) -> list[TinkerFuture]:
    """The tenant's completed saves (of one model, or of all its models whose runs are not
    deleted), newest first."""
    query = (
        select(TinkerFuture)
        .join(TinkerModel, TinkerModel.id == TinkerFuture.model_id)
        .join(Run, Run.id == TinkerModel.run_id)
        .where(
            TinkerFuture.tenant_id == tenant_id,
            TinkerFuture.kind.in_(TYPE_OF_KIND),
            TinkerFuture.status == "complete",
            Run.status != RunStatus.DELETED,
        )
        .order_by(TinkerFuture.completed_at.desc(), TinkerFuture.id.desc())
    )
    if model_id is not None:
        query = query.where(TinkerFuture.model_id == model_id)
    return list(session.scalars(query))


def _checkpoints(saves: list[TinkerFuture]) -> list[CheckpointOut]:
    """One checkpoint per live path, from its newest save (`saves` newest first)."""
    seen: set[str] = set()
    out: list[CheckpointOut] = []
    for future in saves:
        path = future.saved_path()
        if path is None or path in seen or future.completed_at is None:
            continue
        seen.add(path)
        out.append(
            CheckpointOut(
                checkpoint_id=path.split("/", 3)[3],
                checkpoint_type=TYPE_OF_KIND[future.kind],
                time=future.completed_at.isoformat(),
                tinker_path=path,
            )
        )
    return out


def model_checkpoints(session: Session, *, tenant_id: str, model_id: str) -> list[CheckpointOut]:
    """The model's checkpoints, newest first (404 for a model that is not the tenant's)."""
    get_model(session, tenant_id=tenant_id, model_id=model_id)
    return _checkpoints(_saves(session, tenant_id=tenant_id, model_id=model_id))


def latest(checkpoints: list[CheckpointOut], kind: CheckpointType) -> CheckpointOut | None:
    return next((c for c in checkpoints if c.checkpoint_type == kind), None)


def user_checkpoints(
    session: Session, *, tenant_id: str, limit: int, offset: int
) -> tuple[list[CheckpointOut], int]:
    """A page of the checkpoints of all the tenant's models, newest first, and their total."""
    every = _checkpoints(_saves(session, tenant_id=tenant_id))
    return every[offset : offset + limit], len(every)


def _parse(path: str) -> tuple[str, str, str]:
    """`tinker://<model>/<weights|sampler_weights>/<name>` → (model id, save kind, path)."""
    parts = path.removeprefix("tinker://").split("/")
    if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in KIND_OF_SEGMENT or not parts[2]:
        raise ValidationFailed(
            f"not a checkpoint path: {path!r} (tinker://<model_id>/weights/<name> or .../sampler_weights/<name>)"
        )
    return parts[0], KIND_OF_SEGMENT[parts[1]], path


def _live_saves(
    session: Session, *, tenant_id: str, path: str
) -> tuple[TinkerModel, Run, list[TinkerFuture]]:
    """The tenant's model a checkpoint path names, its run, and the saves that named the path
    (404 when there are none: never saved, deleted, or another tenant's)."""
    model_id, kind, path = _parse(path)
    model, run = get_model(session, tenant_id=tenant_id, model_id=model_id)
    saves = [f for f in _saves(session, tenant_id=tenant_id, model_id=model_id) if f.saved_path() == path]
    if kind not in {f.kind for f in saves}:
        raise NotFound(f"checkpoint {path} not found")
    return model, run, saves


def delete_checkpoint(session: Session, *, tenant_id: str, model_id: str, checkpoint_id: str) -> None:
    """Forget `tinker://<model_id>/<checkpoint_id>` (404 when it does not name a live checkpoint)."""
    _, _, saves = _live_saves(session, tenant_id=tenant_id, path=f"tinker://{model_id}/{checkpoint_id}")
    for future in saves:
        # A new dict: the JSON column sees a replaced value, not an in-place change.
        future.result = {**(future.result or {}), CHECKPOINT_DELETED: True}


def weights_info(session: Session, *, tenant_id: str, path: str) -> WeightsInfoOut:
    """What the checkpoint at `path` loads into: base model and LoRA shape."""
    _, run, _ = _live_saves(session, tenant_id=tenant_id, path=path)
    modules = set(run.config["lora"]["target_modules"])
    return WeightsInfoOut(
        base_model=run.base_model,
        lora_rank=int(run.config["lora"]["rank"]),
        train_unembed=bool(modules & set(UNEMBED_MODULES)),
        train_mlp=bool(modules & set(MLP_MODULES)),
        train_attn=bool(modules & set(ATTN_MODULES)),
    )


def with_latest_checkpoints(session: Session, *, tenant_id: str, run_out: TrainingRunOut) -> TrainingRunOut:
    """`run_out` with its newest training and sampler checkpoints."""
    listed = _checkpoints(_saves(session, tenant_id=tenant_id, model_id=run_out.training_run_id))
    return run_out.model_copy(
        update={
            "last_checkpoint": latest(listed, "training"),
            "last_sampler_checkpoint": latest(listed, "sampler"),
        }
    )
