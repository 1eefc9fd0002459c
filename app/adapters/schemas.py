"""Wire shapes of adapters, step metrics and checkpoints (docs/contracts.md)."""

from typing import Annotated

from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict

from app.timestamps import UtcDatetime
from contracts.pool_api import AdapterStored, StepMetricsIn

StepParam = Annotated[int, PathParam(ge=0, le=10_000_000)]
"""A step in a route's path (the pool's adapter uploads, the dashboard's downloads)."""


class AdapterOut(AdapterStored):
    created_at: UtcDatetime


class AdapterList(BaseModel):
    items: list[AdapterOut]


class Aggregate(BaseModel):
    """Over the samples of one rollout step; std is the population std (ddof=0)."""

    mean: float
    std: float
    min: float | None
    max: float | None
    count: int


class MetricsItem(StepMetricsIn):
    """One step: the trainer's figures for the run step `step` (null while not trained), and the
    rewards and per-sample metrics of the rollout batches sampled at step `step` (null if none)."""

    model_config = ConfigDict(extra="ignore")

    step: int
    created_at: UtcDatetime | None = None
    """When the trainer reported the step."""
    samples_received: int | None = None
    """Rollout samples received for this step."""
    reward: Aggregate | None = None
    sample_metrics: dict[str, Aggregate] | None = None


class MetricsList(BaseModel):
    items: list[MetricsItem]
    next_since_step: int | None = None
    """Pass as `since_step` for the next page; null at the end."""


class CheckpointOut(BaseModel):
    run_id: str
    step: int
    total_samples: int
    created_at: UtcDatetime
