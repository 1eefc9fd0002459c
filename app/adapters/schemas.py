"""Wire shapes of adapters, step metrics and checkpoints (docs/contracts.md)."""

from pydantic import BaseModel, ConfigDict

from app.timestamps import UtcDatetime
from contracts.pool_api import AdapterStored, StepMetricsIn


class AdapterOut(AdapterStored):
    created_at: UtcDatetime


class AdapterList(BaseModel):
    items: list[AdapterOut]


class MetricsItem(StepMetricsIn):
    model_config = ConfigDict(extra="ignore")

    step: int
    created_at: UtcDatetime


class MetricsList(BaseModel):
    items: list[MetricsItem]


class CheckpointOut(BaseModel):
    run_id: str
    step: int
    total_samples: int
    created_at: UtcDatetime
