"""Wire shapes of adapters, step metrics and checkpoints (docs/contracts.md)."""

from typing import Annotated

from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from app.timestamps import UtcDatetime
from contracts.pool_api import AdapterStored, StepMetricsIn

StepParam = Annotated[int, PathParam(ge=0, le=10_000_000)]
"""A step in a route's path (the pool's adapter uploads, the dashboard's downloads)."""


class AdapterOut(AdapterStored):
    created_at: UtcDatetime


class AdapterList(BaseModel):
    """A page of a run's adapters, in step order (ascending, or descending with `newest_first`); the
    whole list (its newest 1,000 at most, oldest first) when the request has no paging parameter (no
    `limit`, `cursor` or `newest_first`)."""

    items: list[AdapterOut]
    next_cursor: str | None = Field(
        description="Pass as `cursor` (with the same `newest_first`) for the next page; null on the last "
        "one. A cursor of the other order, or of another list, is a 422."
    )


class Aggregate(BaseModel):
    """Over a set of samples (one rollout step's, or those of several pooled); std is the population
    std (ddof=0)."""

    mean: float
    std: float
    min: float | None
    max: float | None
    count: int


class MetricsItem(StepMetricsIn):
    """One step number, two joins. The trainer's figures (loss ... mfu, created_at) are those of run
    step `step`, and `trained_rollout_steps` / `trained_reward` say which samples that step trained.
    `samples_received`, `reward` and `sample_metrics` are keyed by rollout step: the batches sampled
    with adapter step `step`, which a later step trains (`step` + 1 or later), so they do not describe
    the samples behind this item's loss."""

    model_config = ConfigDict(extra="ignore")

    step: int
    created_at: UtcDatetime | None = Field(
        default=None, description="When the trainer reported step `step`; null while it is not trained."
    )
    trained_rollout_steps: list[int] | None = Field(
        default=None,
        description=(
            "Trainer step `step`: the rollout steps (adapter steps they were sampled with) of the"
            " batches the pool acknowledged as trained in it, ascending. Null while no batch is"
            " acknowledged as trained in this step (not trained yet, its acknowledgement on its"
            " way, or a run trained through the Tinker API, which has no rollout batches)."
        ),
    )
    trained_reward: Aggregate | None = Field(
        default=None,
        description=(
            "Trainer step `step`: the rewards of exactly the batches the pool acknowledged as trained"
            " in it, merged (a rollout step whose batches were trained in two steps counts in each"
            " with the batches that step trained). A batch stored before the service kept a reward"
            " summary per batch (migration 0019) has none: its rollout step counts whole instead, as"
            " the rewards of all that rollout step's batches. Null without rewards."
        ),
    )
    samples_received: int | None = Field(
        default=None,
        description=(
            "Rollout step `step`: the samples received that were sampled with adapter step `step`,"
            " with or without a reward."
        ),
    )
    reward: Aggregate | None = Field(
        default=None,
        description=(
            "Rollout step `step`: the rewards of the batches sampled with adapter step `step`"
            " (trained in a later step; see `trained_reward` for the step that trained them)."
            " Null if none came with a reward."
        ),
    )
    sample_metrics: dict[str, Aggregate] | None = Field(
        default=None,
        description="Rollout step `step`: the per-sample metrics of those batches, by name.",
    )


class MetricsList(BaseModel):
    items: list[MetricsItem]
    next_since_step: int | None = None
    """Pass as `since_step` for the next page; null at the end."""


class CheckpointOut(BaseModel):
    run_id: str
    step: int
    total_samples: int
    created_at: UtcDatetime
